#include "attention.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace verispec {
namespace {

// q . k over `dim` floats in a fixed order (eight running sums, then a fixed tree), which the
// compiler vectorizes without reassociating.
__attribute__((target_clones("avx2", "default")))
float dot(const float* q, const float* k, int64_t dim) {
  float part[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8) {
    for (int j = 0; j < 8; ++j) part[j] += q[d + j] * k[d + j];
  }
  for (int j = 0; d < dim; ++d, ++j) part[j] += q[d] * k[d];
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

__attribute__((target_clones("avx2", "default")))
void add_scaled(float* acc, const float* v, float weight, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += weight * v[d];
}

}  // namespace

torch::Tensor paged_attention_rows(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                   const torch::Tensor& block_tables, const torch::Tensor& row_seq,
                                   const torch::Tensor& row_first,
                                   const torch::Tensor& row_visible,
                                   const torch::Tensor& row_tree_start,
                                   const torch::Tensor& tree_mask, double scale, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "q must be [R, Hq, D] float32");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.scalar_type() == torch::kFloat32 &&
                  kv_cache.is_contiguous(),
              "kv_cache must be contiguous [2, blocks, block_size, Hkv, D] float32");
  const torch::Tensor qc = q.contiguous();
  const int64_t rows = qc.size(0), heads = qc.size(1), dim = qc.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == dim && heads % kv_heads == 0, "q and kv_cache heads differ");
  const torch::Tensor tables = block_tables.contiguous(), seqs = row_seq.contiguous();
  const torch::Tensor visible = row_visible.contiguous(), tree_start = row_tree_start.contiguous();
  const torch::Tensor first = row_first.contiguous();
  const torch::Tensor mask = tree_mask.to(torch::kBool).contiguous();
  const int64_t max_new = mask.size(1), table_width = tables.size(1);
  auto out = torch::empty({rows, heads * dim}, qc.options());

  const float* qp = qc.data_ptr<float>();
  const float* keys = kv_cache.data_ptr<float>();
  const float* values = keys + num_blocks * block_size * kv_heads * dim;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* sp = seqs.data_ptr<int64_t>();
  const int64_t* vp = visible.data_ptr<int64_t>();
  const int64_t* fp = first.data_ptr<int64_t>();
  const int64_t* tsp = tree_start.data_ptr<int64_t>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int64_t group = heads / kv_heads;
  const float fscale = static_cast<float>(scale);
  const float cap = static_cast<float>(softcap);

  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> slots;
    std::vector<float> scores;
    std::vector<float> acc(dim);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / heads, h = i % heads, kvh = h / group;
      const int64_t* table = tp + sp[r] * table_width;
      slots.clear();
      for (int64_t p = fp[r]; p < vp[r]; ++p) {
        slots.push_back(table[p / block_size] * block_size + p % block_size);
      }
      for (int64_t j = 0; j < max_new; ++j) {
        if (mp[r * max_new + j]) {
          const int64_t p = tsp[r] + j;
          if (p < fp[r]) continue;
          slots.push_back(table[p / block_size] * block_size + p % block_size);
        }
      }
      const float* query = qp + (r * heads + h) * dim;
      scores.resize(slots.size());
      float best = -std::numeric_limits<float>::infinity();
      for (size_t k = 0; k < slots.size(); ++k) {
        scores[k] = dot(query, keys + (slots[k] * kv_heads + kvh) * dim, dim) * fscale;
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
      float* dst = op + r * heads * dim + h * dim;
      const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
      for (int64_t d = 0; d < dim; ++d) dst[d] = acc[d] * inverse;
    }
  });
  return out;
}

}  // namespace verispec
