#include "attention.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <limits>
#include <vector>

namespace verispec {
namespace {

float widen(float value) { return value; }
float widen(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// q . k over `dim` values in a fixed order (eight running sums, then a fixed tree), which the
// compiler vectorizes without reassociating. A float16 cache's values (uint16_t bits) are
// widened exactly first, so every path gives the float32 kernel's result on the widened values.
template <typename T>
__attribute__((always_inline)) inline float dot_in_order(const float* q, const T* k, int64_t dim) {
  float part[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8) {
    for (int j = 0; j < 8; ++j) part[j] += q[d + j] * widen(k[d + j]);
  }
  for (int j = 0; d < dim; ++d, ++j) part[j] += q[d] * widen(k[d]);
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

template <typename T>
__attribute__((always_inline)) inline void add_scaled_in_order(float* acc, const T* v, float weight,
                                                               int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += weight * widen(v[d]);
}

__attribute__((target_clones("avx2", "default")))
float dot(const float* q, const float* k, int64_t dim) { return dot_in_order(q, k, dim); }

__attribute__((target_clones("avx2", "default")))
void add_scaled(float* acc, const float* v, float weight, int64_t dim) {
  add_scaled_in_order(acc, v, weight, dim);
}

// The same two operations over a float16 cache with F16C: eight values widened per instruction,
// then the operations above in the same order.
__attribute__((target("avx2,f16c")))
float dot_f16c(const float* q, const uint16_t* k, int64_t dim) {
  __m256 part = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8) {
    const __m256 kk = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k + d)));
    part = _mm256_add_ps(part, _mm256_mul_ps(_mm256_loadu_ps(q + d), kk));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, part);
  for (int j = 0; d < dim; ++d, ++j) lanes[j] += q[d] * widen(k[d]);
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

__attribute__((target("avx2,f16c")))
void add_scaled_f16c(float* acc, const uint16_t* v, float weight, int64_t dim) {
  const __m256 w = _mm256_set1_ps(weight);
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8) {
    const __m256 vv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + d)));
    _mm256_storeu_ps(acc + d, _mm256_add_ps(_mm256_loadu_ps(acc + d), _mm256_mul_ps(w, vv)));
  }
  for (; d < dim; ++d) acc[d] += weight * widen(v[d]);
}

// VERISPEC_CPU_KERNEL=generic forces the portable path, as it does for the products.
bool has_f16c() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
                          !(std::getenv("VERISPEC_CPU_KERNEL") &&
                            std::string(std::getenv("VERISPEC_CPU_KERNEL")) == "generic");
  return yes;
}

float dot(const float* q, const uint16_t* k, int64_t dim) {
  return has_f16c() ? dot_f16c(q, k, dim) : dot_in_order(q, k, dim);
}

void add_scaled(float* acc, const uint16_t* v, float weight, int64_t dim) {
  has_f16c() ? add_scaled_f16c(acc, v, weight, dim) : add_scaled_in_order(acc, v, weight, dim);
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
      std::vector<int64_t> slots;
      std::vector<float> scores;
      std::vector<float> acc(dim);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = i / heads, h = i % heads, kvh = h / group;
        const int64_t* table = plan.block_tables + plan.row_seq[r] * plan.table_width;
        const int64_t first = plan.row_first[r];
        slots.clear();
        for (int64_t p = first; p < plan.row_visible[r]; ++p) {
          slots.push_back(table[p / block_size] * block_size + p % block_size);
        }
        for (int64_t j = 0; j < plan.max_new; ++j) {
          if (plan.tree_mask[r * plan.max_new + j]) {
            const int64_t p = plan.row_tree_start[r] + j;
            if (p < first) continue;
            slots.push_back(table[p / block_size] * block_size + p % block_size);
          }
        }
        const float* query = q + r * q_stride + h * dim;
        scores.resize(slots.size());
        float best = -std::numeric_limits<float>::infinity();
        for (size_t k = 0; k < slots.size(); ++k) {
          scores[k] = dot(query, keys + (slots[k] * kv_heads + kvh) * dim, dim) * scale;
          if (cap > 0.0f) scores[k] = std::tanh(scores[k] / cap) * cap;
          best = std::fmax(best, scores[k]);
        }
        std::fill(acc.begin(), acc.end(), 0.0f);
        float total = 0.0f;
        for (size_t k = 0; k < slots.size(); ++k) {
          const float weight = std::exp(scores[k] - best);
          total += weight;
          add_scaled(acc.data(), values + (slots[k] * kv_heads + kvh) * dim, weight, dim);
        }
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
