#include "attention.h"
#include "qlinear.h"
#include "vecmath.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

namespace verispec {
namespace {

float widen(float value) { return value; }
float widen(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// The operations every path performs, per key and per value element, in this order:
//   score = q . k over `dim` values in eight running sums (sum j takes elements d = j mod 8),
//           then ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7));
//   acc[d] += weight * v[d], key after key.
// A float16 cache's values (uint16_t bits) are widened exactly first, so every path gives the
// float32 cache's result on the widened values.
template <typename T>
float dot_in_order(const float* q, const T* k, int64_t dim) {
  float part[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8) {
    for (int j = 0; j < 8; ++j) part[j] += q[d + j] * widen(k[d + j]);
  }
  for (int j = 0; d < dim; ++d, ++j) part[j] += q[d] * widen(k[d]);
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// The portable path: one key, then one value, at a time.
template <typename T>
void scores_in_order(const float* q, const T* keys, const int64_t* offsets, int64_t n,
                     int64_t dim, float* scores) {
  for (int64_t i = 0; i < n; ++i) scores[i] = dot_in_order(q, keys + offsets[i], dim);
}

template <typename T>
void values_in_order(float* acc, const T* values, const int64_t* offsets, const float* weights,
                     int64_t n, int64_t dim) {
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t d = 0; d < dim; ++d) acc[d] += weights[i] * widen(values[offsets[i] + d]);
  }
}

// The same operations eight keys at a time with AVX2 (F16C widening a float16 cache): a key's
// eight running sums are one register, eight keys' registers are independent chains (one key
// alone waits on each addition's latency), and the final tree is two rounds of hadd, which
// pair the sums exactly as above. Values: 64 elements of acc stay in registers over all keys.
__attribute__((target("avx2,f16c"))) inline __m256 load8(const float* p) {
  return _mm256_loadu_ps(p);
}
__attribute__((target("avx2,f16c"))) inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <typename T>
__attribute__((target("avx2,f16c"))) void scores_avx2(const float* q, const T* keys,
                                                      const int64_t* offsets, int64_t n,
                                                      int64_t dim, float* scores) {
  if (dim % 8 != 0) return scores_in_order(q, keys, offsets, n, dim, scores);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
      const __m256 qq = _mm256_loadu_ps(q + d);
      for (int j = 0; j < 8; ++j) {
        acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(qq, load8(keys + offsets[i + j] + d)));
      }
    }
    const __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 h4567 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    _mm_storeu_ps(scores + i, _mm_add_ps(_mm256_castps256_ps128(h0123), _mm256_extractf128_ps(h0123, 1)));
    _mm_storeu_ps(scores + i + 4, _mm_add_ps(_mm256_castps256_ps128(h4567), _mm256_extractf128_ps(h4567, 1)));
  }
  for (; i < n; ++i) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
      acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(q + d), load8(keys + offsets[i] + d)));
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc, acc), _mm256_hadd_ps(acc, acc));
    scores[i] = _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
}

template <typename T>
__attribute__((target("avx2,f16c"))) void values_avx2(float* acc, const T* values,
                                                      const int64_t* offsets, const float* weights,
                                                      int64_t n, int64_t dim) {
  int64_t d0 = 0;
  for (; d0 + 64 <= dim; d0 += 64) {
    __m256 sum[8];
    for (int c = 0; c < 8; ++c) sum[c] = _mm256_loadu_ps(acc + d0 + 8 * c);
    for (int64_t i = 0; i < n; ++i) {
      const __m256 w = _mm256_set1_ps(weights[i]);
      const T* v = values + offsets[i] + d0;
      for (int c = 0; c < 8; ++c) sum[c] = _mm256_add_ps(sum[c], _mm256_mul_ps(w, load8(v + 8 * c)));
    }
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(acc + d0 + 8 * c, sum[c]);
  }
  for (; d0 + 8 <= dim; d0 += 8) {
    __m256 sum = _mm256_loadu_ps(acc + d0);
    for (int64_t i = 0; i < n; ++i) {
      sum = _mm256_add_ps(sum, _mm256_mul_ps(_mm256_set1_ps(weights[i]), load8(values + offsets[i] + d0)));
    }
    _mm256_storeu_ps(acc + d0, sum);
  }
  for (int64_t i = 0; i < n && d0 < dim; ++i) {
    for (int64_t d = d0; d < dim; ++d) acc[d] += weights[i] * widen(values[offsets[i] + d]);
  }
}

template <typename T>
void scores_of(const float* q, const T* keys, const int64_t* offsets, int64_t n, int64_t dim,
               float* scores) {
  use_avx2_f16c() ? scores_avx2(q, keys, offsets, n, dim, scores)
             : scores_in_order(q, keys, offsets, n, dim, scores);
}

template <typename T>
void values_of(float* acc, const T* values, const int64_t* offsets, const float* weights,
               int64_t n, int64_t dim) {
  use_avx2_f16c() ? values_avx2(acc, values, offsets, weights, n, dim)
             : values_in_order(acc, values, offsets, weights, n, dim);
}

}  // namespace

RowPlan RowPlan::of(const std::vector<torch::Tensor>& tensors) {
  TORCH_CHECK(tensors.size() == 6, "a row plan is 6 tensors: block_tables, row_seq, row_first, "
              "row_visible, row_tree_start, tree_mask");
  for (size_t i = 0; i < 5; ++i) {
    TORCH_CHECK(tensors[i].scalar_type() == torch::kInt64 && tensors[i].is_contiguous(),
                "row plan tensor ", i, " must be contiguous int64");
  }
  const torch::Tensor& mask = tensors[5];
  TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.is_contiguous() && mask.dim() == 2,
              "tree_mask must be a contiguous [R, max_new] bool tensor");
  return RowPlan{tensors[0].data_ptr<int64_t>(), tensors[0].size(1), tensors[1].data_ptr<int64_t>(),
                 tensors[2].data_ptr<int64_t>(), tensors[3].data_ptr<int64_t>(),
                 tensors[4].data_ptr<int64_t>(), mask.data_ptr<bool>(), mask.size(1)};
}

void attend_rows(const float* q, int64_t q_stride, int64_t rows, int64_t heads, int64_t dim,
                 const torch::Tensor& kv_cache, const RowPlan& plan, float scale, float cap,
                 float* out) {
  RECORD_USER_SCOPE("verispec::attention");
  const bool half = kv_cache.scalar_type() == torch::kHalf;
  TORCH_CHECK(kv_cache.dim() == 5 && (half || kv_cache.scalar_type() == torch::kFloat32) &&
                  kv_cache.is_contiguous(),
              "kv_cache must be contiguous [2, blocks, block_size, Hkv, D] float32 or float16");
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == dim && heads % kv_heads == 0, "q and kv_cache heads differ");
  const int64_t values_offset = num_blocks * block_size * kv_heads * dim;  // values after keys
  const int64_t group = heads / kv_heads;

  auto attend = [&](const auto* keys) {
    const auto* values = keys + values_offset;
    at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<int64_t> offsets;  // of each attended position's key / value, in elements
      std::vector<float> scores;
      std::vector<float> acc(dim);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = i / heads, h = i % heads, kvh = h / group;
        const int64_t* table = plan.block_tables + plan.row_seq[r] * plan.table_width;
        const int64_t first = plan.row_first[r];
        auto attend_position = [&](int64_t p) {
          const int64_t slot = table[p / block_size] * block_size + p % block_size;
          offsets.push_back((slot * kv_heads + kvh) * dim);
        };
        offsets.clear();
        for (int64_t p = first; p < plan.row_visible[r]; ++p) attend_position(p);
        for (int64_t j = 0; j < plan.max_new; ++j) {
          const int64_t p = plan.row_tree_start[r] + j;
          if (plan.tree_mask[r * plan.max_new + j] && p >= first) attend_position(p);
        }
        const int64_t n = static_cast<int64_t>(offsets.size());
        scores.resize(n);
        scores_of(q + r * q_stride + h * dim, keys, offsets.data(), n, dim, scores.data());
        float best = -std::numeric_limits<float>::infinity();
        for (int64_t k = 0; k < n; ++k) {
          scores[k] *= scale;
          if (cap > 0.0f) scores[k] = std::tanh(scores[k] / cap) * cap;
          best = std::fmax(best, scores[k]);
        }
        exp_shifted(scores.data(), n, best);  // the weights
        float total = 0.0f;
        for (int64_t k = 0; k < n; ++k) total += scores[k];
        std::fill(acc.begin(), acc.end(), 0.0f);
        values_of(acc.data(), values, offsets.data(), scores.data(), n, dim);
        float* dst = out + r * heads * dim + h * dim;
        const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t d = 0; d < dim; ++d) dst[d] = acc[d] * inverse;
      }
    });
  };
  if (half) {
    attend(reinterpret_cast<const uint16_t*>(kv_cache.data_ptr<at::Half>()));
  } else {
    attend(kv_cache.data_ptr<float>());
  }
}

torch::Tensor paged_attention_rows(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                   const torch::Tensor& block_tables, const torch::Tensor& row_seq,
                                   const torch::Tensor& row_first,
                                   const torch::Tensor& row_visible,
                                   const torch::Tensor& row_tree_start,
                                   const torch::Tensor& tree_mask, double scale, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "q must be [R, Hq, D] float32");
  const torch::Tensor qc = q.contiguous();
  const int64_t rows = qc.size(0), heads = qc.size(1), dim = qc.size(2);
  const std::vector<torch::Tensor> tensors = {
      block_tables.contiguous(), row_seq.contiguous(), row_first.contiguous(),
      row_visible.contiguous(), row_tree_start.contiguous(), tree_mask.to(torch::kBool).contiguous()};
  auto out = torch::empty({rows, heads * dim}, qc.options());
  attend_rows(qc.data_ptr<float>(), heads * dim, rows, heads, dim, kv_cache, RowPlan::of(tensors),
              static_cast<float>(scale), static_cast<float>(softcap), out.data_ptr<float>());
  return out;
}

}  // namespace verispec
