#include "attention.h"
#include "qlinear.h"
#include "vecmath.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace verispec {
namespace {

float widen(float value) { return value; }
float widen(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// Keys and values are widened to float32 (exactly: a float16 cache gives the float32 cache's
// result on the widened values) a chunk of positions at a time, once for the query heads that
// share them (grouped-query attention), into a buffer each head then reads contiguously.
constexpr int64_t kPositions = 64;
// The most rows of one sequence a task attends: a verify step's all, a prompt chunk's in tasks
// enough to keep every thread busy.
constexpr int64_t kSpanRows = 8;

// The operations every path performs, in this order:
//   score = q . k over `dim` values in eight running sums (sum j takes elements d = j mod 8,
//           each a fused multiply-add), then sum_tree's ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7));
//   acc[d] = fma(weight, v[d], acc[d]), key after key.
float dot_in_order(const float* q, const float* k, int64_t dim) {
  float part[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8) {
    for (int j = 0; j < 8; ++j) part[j] = std::fma(q[d + j], k[d + j], part[j]);
  }
  for (int j = 0; d < dim; ++d, ++j) part[j] = std::fma(q[d], k[d], part[j]);
  return sum_tree(part);
}

// The portable path: dim-long rows `keys` [n, dim] against q, and value rows into acc.
void scores_in_order(const float* q, const float* keys, int64_t n, int64_t dim, float* scores) {
  for (int64_t i = 0; i < n; ++i) scores[i] = dot_in_order(q, keys + i * dim, dim);
}

void values_in_order(float* acc, const float* values, const float* weights, int64_t n,
                     int64_t dim) {
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t d = 0; d < dim; ++d) acc[d] = std::fma(weights[i], values[i * dim + d], acc[d]);
  }
}

// A row's keys and values lie scattered over the cache (a block per 16 positions, each layer's
// cache its own tensor, read once a step): loading one position after another waits on memory
// each time unless fetched ahead, so widening position i fetches position i + kAhead of the
// `ahead` positions from offsets[0] on (the next chunk's first ones too). Measured on a
// Skylake-SP core, 30 layers' caches: 13-14 % off one layer's attention at 300 and 1,000 positions.
constexpr int64_t kAhead = 16;

template <typename T>
void fetch_ahead(const T* src, const int64_t* offsets, int64_t i, int64_t ahead, int64_t dim) {
  if (i + kAhead >= ahead) return;
  const char* p = reinterpret_cast<const char*>(src + offsets[i + kAhead]);
  for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

template <typename T>
void widen_in_order(const T* src, const int64_t* offsets, int64_t n, int64_t ahead, int64_t dim,
                    float* dst) {
  for (int64_t i = 0; i < n; ++i) {
    fetch_ahead(src, offsets, i, ahead, dim);
    for (int64_t d = 0; d < dim; ++d) dst[i * dim + d] = widen(src[offsets[i] + d]);
  }
}

// The same operations with AVX2, FMA and F16C: a key's eight running sums are one register,
// eight keys' registers are independent chains (one key alone waits on each addition's
// latency), and the final tree is two rounds of hadd, which pair the sums exactly as above.
// Values: 64 elements of acc stay in registers over a chunk's keys.
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const float* p) {
  return _mm256_loadu_ps(p);
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <typename T>
__attribute__((target("avx2,fma,f16c"))) void widen_avx2(const T* src, const int64_t* offsets,
                                                          int64_t n, int64_t ahead, int64_t dim,
                                                          float* dst) {
  for (int64_t i = 0; i < n; ++i) {
    fetch_ahead(src, offsets, i, ahead, dim);
    for (int64_t d = 0; d < dim; d += 8) _mm256_storeu_ps(dst + i * dim + d, load8(src + offsets[i] + d));
  }
}

__attribute__((target("avx2,fma,f16c"))) void scores_avx2(const float* q, const float* keys,
                                                          int64_t n, int64_t dim, float* scores) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
      const __m256 qq = _mm256_loadu_ps(q + d);
      for (int j = 0; j < 8; ++j) {
        acc[j] = _mm256_fmadd_ps(qq, _mm256_loadu_ps(keys + (i + j) * dim + d), acc[j]);
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
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(keys + i * dim + d), acc);
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc, acc), _mm256_hadd_ps(acc, acc));
    scores[i] = _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
}

__attribute__((target("avx2,fma,f16c"))) void values_avx2(float* acc, const float* values,
                                                          const float* weights, int64_t n,
                                                          int64_t dim) {
  int64_t d0 = 0;
  for (; d0 + 64 <= dim; d0 += 64) {
    __m256 sum[8];
    for (int c = 0; c < 8; ++c) sum[c] = _mm256_loadu_ps(acc + d0 + 8 * c);
    for (int64_t i = 0; i < n; ++i) {
      const __m256 w = _mm256_set1_ps(weights[i]);
      const float* v = values + i * dim + d0;
      for (int c = 0; c < 8; ++c) sum[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * c), sum[c]);
    }
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(acc + d0 + 8 * c, sum[c]);
  }
  for (; d0 < dim; d0 += 8) {
    __m256 sum = _mm256_loadu_ps(acc + d0);
    for (int64_t i = 0; i < n; ++i) {
      sum = _mm256_fmadd_ps(_mm256_set1_ps(weights[i]), _mm256_loadu_ps(values + i * dim + d0), sum);
    }
    _mm256_storeu_ps(acc + d0, sum);
  }
}

// The vector paths need whole registers of a head's values.
bool vector_path(int64_t dim) { return use_avx2_f16c() && dim % 8 == 0; }

template <typename T>
void widen_rows(const T* src, const int64_t* offsets, int64_t n, int64_t ahead, int64_t dim,
                float* dst) {
  vector_path(dim) ? widen_avx2(src, offsets, n, ahead, dim, dst)
                   : widen_in_order(src, offsets, n, ahead, dim, dst);
}

void scores_of(const float* q, const float* keys, int64_t n, int64_t dim, float* scores) {
  vector_path(dim) ? scores_avx2(q, keys, n, dim, scores)
                   : scores_in_order(q, keys, n, dim, scores);
}

void values_of(float* acc, const float* values, const float* weights, int64_t n, int64_t dim) {
  vector_path(dim) ? values_avx2(acc, values, weights, n, dim)
                   : values_in_order(acc, values, weights, n, dim);
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

  // Spans: runs of consecutive rows of one sequence from one first position without tree
  // positions (a verify step's rows, which attend nested prefixes of one context). A span's
  // keys and values are widened once for all its rows; each row still computes its scores,
  // weights and sums alone and in the same order, so its result is the one it has on its own.
  std::vector<int64_t> span_start;
  auto plain = [&](int64_t r) {
    for (int64_t j = 0; j < plan.max_new; ++j) {
      if (plan.tree_mask[r * plan.max_new + j]) return false;
    }
    return true;
  };
  bool previous_plain = false;
  for (int64_t r = 0; r < rows; ++r) {
    const bool this_plain = plain(r);
    const bool joins = r > 0 && r - span_start.back() < kSpanRows && plan.row_seq[r] == plan.row_seq[r - 1] &&
                       plan.row_first[r] == plan.row_first[r - 1] && this_plain && previous_plain;
    if (!joins) span_start.push_back(r);
    previous_plain = this_plain;
  }
  const int64_t spans = static_cast<int64_t>(span_start.size());
  span_start.push_back(rows);

  auto attend = [&](const auto* keys) {
    const auto* values = keys + values_offset;
    // One task per span and key/value head: the group's query heads share its widened keys.
    at::parallel_for(0, spans * kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<int64_t> offsets;  // of each attended position's key / value, in elements
      std::vector<float> scores;     // [span rows, group, n]
      std::vector<int64_t> lengths;  // per span row, its positions: a prefix of `offsets`
      std::vector<float> acc, totals, chunk(kPositions * dim);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t span = i / kv_heads, kvh = i % kv_heads;
        const int64_t r0 = span_start[span], count = span_start[span + 1] - r0;
        const int64_t* table = plan.block_tables + plan.row_seq[r0] * plan.table_width;
        const int64_t first = plan.row_first[r0];
        int64_t visible = first;
        for (int64_t r = r0; r < r0 + count; ++r) visible = std::max(visible, plan.row_visible[r]);
        auto slot_of = [&](int64_t p) { return table[p / block_size] * block_size + p % block_size; };
        offsets.clear();
        for (int64_t p = first; p < visible;) {  // block by block: one division per block
          const int64_t block_end = std::min(visible, (p / block_size + 1) * block_size);
          const int64_t slot = slot_of(p);
          for (int64_t s = slot; p < block_end; ++p, ++s) offsets.push_back((s * kv_heads + kvh) * dim);
        }
        lengths.assign(count, 0);
        for (int64_t j = 0; j < count; ++j) {
          lengths[j] = std::max<int64_t>(0, plan.row_visible[r0 + j] - first);
        }
        if (count == 1) {  // a lone row may be a tree row: its tree positions follow
          for (int64_t j = 0; j < plan.max_new; ++j) {
            const int64_t p = plan.row_tree_start[r0] + j;
            if (plan.tree_mask[r0 * plan.max_new + j] && p >= first) {
              offsets.push_back((slot_of(p) * kv_heads + kvh) * dim);
            }
          }
          lengths[0] = static_cast<int64_t>(offsets.size());
        }
        const int64_t n = static_cast<int64_t>(offsets.size());
        scores.resize(count * group * n);
        for (int64_t c = 0; c < n; c += kPositions) {
          const int64_t m = std::min(kPositions, n - c);
          widen_rows(keys, offsets.data() + c, m, n - c, dim, chunk.data());
          for (int64_t j = 0; j < count; ++j) {
            const int64_t mine = std::min(m, lengths[j] - c);
            const float* q_group = q + (r0 + j) * q_stride + kvh * group * dim;
            for (int64_t h = 0; mine > 0 && h < group; ++h) {
              scores_of(q_group + h * dim, chunk.data(), mine, dim, scores.data() + (j * group + h) * n + c);
            }
          }
        }
        totals.resize(count * group);
        for (int64_t j = 0; j < count; ++j) {
          for (int64_t h = 0; h < group; ++h) {
            float* weights = scores.data() + (j * group + h) * n;
            scale_scores(weights, lengths[j], scale, cap);
            exp_shifted(weights, lengths[j], max_of(weights, lengths[j]));  // the weights
            totals[j * group + h] = sum_in_lanes(weights, lengths[j]);
          }
        }
        acc.assign(count * group * dim, 0.0f);
        for (int64_t c = 0; c < n; c += kPositions) {
          const int64_t m = std::min(kPositions, n - c);
          widen_rows(values, offsets.data() + c, m, n - c, dim, chunk.data());
          for (int64_t j = 0; j < count; ++j) {
            const int64_t mine = std::min(m, lengths[j] - c);
            for (int64_t h = 0; mine > 0 && h < group; ++h) {
              values_of(acc.data() + (j * group + h) * dim, chunk.data(),
                        scores.data() + (j * group + h) * n + c, mine, dim);
            }
          }
        }
        for (int64_t j = 0; j < count; ++j) {
          for (int64_t h = 0; h < group; ++h) {
            float* dst = out + (r0 + j) * heads * dim + (kvh * group + h) * dim;
            const float total = totals[j * group + h];
            const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
            for (int64_t d = 0; d < dim; ++d) dst[d] = acc[(j * group + h) * dim + d] * inverse;
          }
        }
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
