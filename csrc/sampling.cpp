#include "sampling.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "checks.h"

namespace verispec {
namespace {

template <typename T>
int64_t draw(const T* w, int64_t n, double u) {
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += static_cast<double>(w[i]);
  const double target = u * total;
  double running = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    running += static_cast<double>(w[i]);
    if (running > target) return i;
  }
  return n - 1;
}

void row_top(const float* x, int64_t n, int64_t width, float* out) {
  // Columns g, g + G, g + 2G, ... of the first 16 G form group g. The width-th largest of the
  // groups' maxima bounds the row's width-th largest value from below (those maxima are width
  // values of the row), so the values at or above it hold the row's top `width`: usually a few
  // hundred candidates to sort instead of the whole row. Maxima of strided groups are taken
  // slice against slice, which vectorizes.
  constexpr int64_t kSlices = 16;
  const int64_t groups = n / kSlices;
  std::vector<float> candidates;
  if (groups >= width) {
    std::vector<float> maxima(x, x + groups);
    for (int64_t k = 1; k < kSlices; ++k) {
      const float* slice = x + k * groups;
      for (int64_t g = 0; g < groups; ++g) maxima[g] = maxima[g] < slice[g] ? slice[g] : maxima[g];
    }
    std::nth_element(maxima.begin(), maxima.begin() + (width - 1), maxima.end(), std::greater<float>());
    const float bound = maxima[width - 1];
    for (int64_t i = 0; i < n; ++i) {
      if (x[i] >= bound) candidates.push_back(x[i]);
    }
  } else {
    candidates.assign(x, x + n);
  }
  std::partial_sort(candidates.begin(), candidates.begin() + width, candidates.end(), std::greater<float>());
  std::copy(candidates.begin(), candidates.begin() + width, out);
}

uint64_t splitmix64(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// rng.py's mix: a stream's key (or seed) with a counter (a step, or a position and purpose).
uint64_t mix(int64_t key, uint64_t counter) {
  return splitmix64(static_cast<uint64_t>(key) ^ splitmix64(counter));
}

}  // namespace

torch::Tensor request_keys(const torch::Tensor& seeds, const torch::Tensor& steps) {
  const int64_t n = seeds.numel();
  check_int64s(seeds, n, "seeds");
  check_int64s(steps, n, "steps");
  auto out = torch::empty({n}, torch::kInt64);
  const int64_t* seed = seeds.data_ptr<int64_t>();
  const int64_t* step = steps.data_ptr<int64_t>();
  int64_t* key = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    key[i] = static_cast<int64_t>(mix(seed[i], static_cast<uint64_t>(step[i])));
  }
  return out;
}

torch::Tensor uniform(const torch::Tensor& keys, const torch::Tensor& positions, int64_t purpose) {
  const int64_t n = keys.numel();
  check_int64s(keys, n, "keys");
  check_int64s(positions, n, "positions");
  auto out = torch::empty({n}, torch::kFloat64);
  const int64_t* key = keys.data_ptr<int64_t>();
  const int64_t* position = positions.data_ptr<int64_t>();
  double* u = out.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t counter = static_cast<uint64_t>(position[i]) * 8u + static_cast<uint64_t>(purpose);
    const uint64_t bits = mix(key[i], counter);
    u[i] = (static_cast<double>(bits >> 11) + 0.5) * 0x1p-53;
  }
  return out;
}

torch::Tensor fill_below(const torch::Tensor& x, const torch::Tensor& threshold) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "x must be a contiguous [B, V] float32 tensor");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(threshold.numel() == rows && threshold.scalar_type() == torch::kFloat32 &&
                  threshold.is_contiguous(),
              "threshold must be a contiguous float32 tensor of ", rows, " values");
  auto out = torch::empty_like(x);
  const float* src = x.data_ptr<float>();
  const float* bound = threshold.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const float minus_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float t = bound[r];
      const float* row = src + r * n;
      float* to = dst + r * n;
      for (int64_t i = 0; i < n; ++i) to[i] = row[i] < t ? minus_inf : row[i];
    }
  });
  return out;
}

torch::Tensor top_values(const torch::Tensor& x, int64_t width) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "x must be a contiguous [B, V] float32 tensor");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(1 <= width && width <= n, "width=", width, " is invalid: expected 1 .. ", n);
  auto out = torch::empty({rows, width}, torch::kFloat32);
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row_top(src + r * n, n, width, dst + r * width);
  });
  return out;
}

torch::Tensor inverse_cdf(const torch::Tensor& weights, const torch::Tensor& u) {
  TORCH_CHECK(weights.dim() == 2 && weights.is_contiguous() && weights.size(1) > 0 &&
                  (weights.scalar_type() == torch::kFloat32 || weights.scalar_type() == torch::kFloat64),
              "weights must be a contiguous [B, V] float32 or float64 tensor with V > 0");
  const int64_t rows = weights.size(0), n = weights.size(1);
  TORCH_CHECK(u.dim() == 1 && u.numel() == rows && u.scalar_type() == torch::kFloat64 && u.is_contiguous(),
              "u must be a contiguous [", rows, "] float64 tensor");
  auto out = torch::empty({rows}, torch::kInt64);
  int64_t* index = out.data_ptr<int64_t>();
  const double* us = u.data_ptr<double>();
  const bool wide = weights.scalar_type() == torch::kFloat64;
  const void* data = weights.data_ptr();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      index[r] = wide ? draw(static_cast<const double*>(data) + r * n, n, us[r])
                      : draw(static_cast<const float*>(data) + r * n, n, us[r]);
    }
  });
  return out;
}

}  // namespace verispec
