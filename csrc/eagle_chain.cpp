#include "eagle_chain.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "checks.h"
#include "vecmath.h"

namespace verispec {
namespace {

namespace py = pybind11;

// The first maximum of each of `rows` rows of `width` values, as numpy's argmax takes it.
std::vector<int64_t> first_maxima(const torch::Tensor& logits) {
  const int64_t rows = logits.size(0), width = logits.size(1);
  const float* x = logits.data_ptr<float>();
  std::vector<int64_t> best(rows, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * width;
    best[r] = std::max_element(row, row + width) - row;
  }
  return best;
}

// A row's draft column from its logits [n]: the first maximum for a greedy row (temperature 0;
// q [n], zeros, made one-hot there, which greedy verification never reads), else a draw at u
// from q = the softmax of the logits over temperature, kept where at or above the top-k and
// nucleus thresholds (ties kept) and at least min_p of the largest, as
// verispec/sample/processors.py filters, written to q [n].
int64_t pick(const float* logits, int64_t n, float temperature, int64_t top_k, float top_p,
             float min_p, double u, float* q, std::vector<float>& sorted) {
  const int64_t argmax = std::max_element(logits, logits + n) - logits;  // first_maxima's
  if (temperature <= 0.0f) {
    q[argmax] = 1.0f;
    return argmax;
  }
  const float scale = 1.0f / temperature, best = logits[argmax] * scale;
  for (int64_t i = 0; i < n; ++i) q[i] = logits[i] * scale;
  float threshold = -std::numeric_limits<float>::infinity();
  const int64_t kept = top_k > 0 && top_k < n ? top_k : n;
  if (kept < n || top_p < 1.0f) {
    sorted.assign(q, q + n);
    auto larger = std::greater<float>();
    if (kept < n) {  // without top-k, sorted[n - 1] is just the last column's value
      std::nth_element(sorted.begin(), sorted.begin() + kept - 1, sorted.end(), larger);
      threshold = sorted[kept - 1];
    }
    if (top_p < 1.0f) {
      // The nucleus: the first sorted position whose running mass (a share of the kept set's)
      // reaches top_p, found in a sorted head that widens by 8 until it holds it.
      double total = 0.0;
      for (int64_t i = 0; i < kept; ++i) total += std::exp(static_cast<double>(sorted[i] - best));
      int64_t head = std::min<int64_t>(kept, 64), done = 0;
      double running = 0.0;
      while (true) {
        std::partial_sort(sorted.begin() + done, sorted.begin() + head, sorted.begin() + kept, larger);
        int64_t i = done;
        for (; i < head; ++i) {
          running += std::exp(static_cast<double>(sorted[i] - best));
          if (running >= top_p * total) break;
        }
        if (i < head || head == kept) {
          threshold = std::max(threshold, sorted[std::min(i, kept - 1)]);
          break;
        }
        done = head;
        head = std::min(kept, head * 8);
      }
    }
  }
  if (min_p > 0.0f) threshold = std::max(threshold, best + std::log(min_p));
  float mass = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    q[i] = q[i] >= threshold ? std::exp(q[i] - best) : 0.0f;
    mass += q[i];
  }
  for (int64_t i = 0; i < n; ++i) q[i] /= mass;
  // Inverse CDF in float64 over q as handed to the verifier: the first column whose running
  // sum passes u times the whole.
  double whole = 0.0;
  for (int64_t i = 0; i < n; ++i) whole += q[i];
  const double target = u * whole;
  double cdf = 0.0;
  int64_t last = argmax;
  for (int64_t i = 0; i < n; ++i) {
    if (q[i] <= 0.0f) continue;
    cdf += q[i];
    last = i;
    if (cdf > target) return i;
  }
  return last;
}

torch::Tensor int64s(const std::vector<int64_t>& values) {
  auto t = torch::empty({static_cast<int64_t>(values.size())}, torch::kInt64);
  std::copy(values.begin(), values.end(), t.data_ptr<int64_t>());
  return t;
}

void check_floats(const torch::Tensor& t, int64_t rows, int64_t width, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kFloat32 && t.is_contiguous() &&
                  t.size(0) == rows && t.size(1) == width,
              name, " must be a contiguous [", rows, ", ", width, "] float32 tensor");
}

// Whether `linear` maps `in` columns to `out`.
void check_shape(const LinearLayer& linear, int64_t in, int64_t out, const char* name) {
  TORCH_CHECK(linear.out == out && (!linear.dense.defined() || linear.in == in), name,
              " must map ", in, " columns to ", out);
  for (const Panels& part : linear.parts) part.check(in);
}

}  // namespace

EagleChain::EagleChain(const py::dict& linears, int64_t fused_layers,
                       torch::Tensor vocab_embeddings, torch::Tensor vocab, double eps)
    : fc_(linear_from(linears, "fc")), fused_layers_(fused_layers),
      vocab_embeddings_(std::move(vocab_embeddings)), vocab_(std::move(vocab)),
      eps_(static_cast<float>(eps)) {
  const int64_t d = fc_.out;
  check_shape(fc_, 2 * d, d, "fc");
  TORCH_CHECK(fused_layers >= 1, "fused_layers=", fused_layers, " is invalid: expected >= 1");
  fuse_ = linear_from(linears, "fuse");
  check_shape(fuse_, fused_layers * d, d, "fuse");
  TORCH_CHECK(vocab_.dim() == 1 && vocab_.scalar_type() == torch::kInt64 && vocab_.is_contiguous(),
              "vocab must be a contiguous [N] int64 tensor");
  check_floats(vocab_embeddings_, vocab_.numel(), d, "vocab_embeddings");
  ones_ = torch::ones({d}, torch::kFloat32);
}

std::vector<torch::Tensor> EagleChain::draft(const DecoderStack& layer, const torch::Tensor& inputs, const torch::Tensor& embeddings,
                                const torch::Tensor& cos, const torch::Tensor& sin,
                                const std::vector<torch::Tensor>& kv_caches,
                                const torch::Tensor& slots,
                                const std::vector<torch::Tensor>& first_plan,
                                const torch::Tensor& logits_rows,
                                const torch::Tensor& block_tables,
                                const torch::Tensor& chain_start, const torch::Tensor& depths,
                                const std::vector<int64_t>& first_products,
                                const std::vector<int64_t>& chain_products, int64_t head_product,
                                const torch::Tensor& temperature, const torch::Tensor& top_k,
                                const torch::Tensor& top_p, const torch::Tensor& min_p,
                                const torch::Tensor& uniforms) const {
  TORCH_CHECK(layer.has_head() && layer.num_layers() == 1,
              "the stack must be one decoder layer with its norm and LM head");
  const int64_t d = fc_.out, rows = inputs.size(0), requests = logits_rows.numel();
  const int64_t layers_in = fused_layers_ * d;
  check_floats(inputs, rows, layers_in, "inputs");
  check_floats(embeddings, rows, d, "embeddings");
  check_int64s(logits_rows, requests, "logits_rows");
  check_int64s(chain_start, requests, "chain_start");
  check_int64s(depths, requests, "depths");
  TORCH_CHECK(requests > 0, "no request to draft for");
  const int64_t* depth = depths.data_ptr<int64_t>();
  const int64_t max_depth = *std::max_element(depth, depth + requests);
  TORCH_CHECK(*std::min_element(depth, depth + requests) >= 1, "depths must be >= 1");
  const int64_t total = rows + (max_depth - 1) * requests;
  check_int64s(slots, total, "slots");
  TORCH_CHECK(cos.size(0) == total && sin.size(0) == total && cos.is_contiguous() &&
                  sin.is_contiguous(),
              "cos and sin must have a row for each of the ", total, " rows");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == requests &&
                  block_tables.scalar_type() == torch::kInt64 && block_tables.is_contiguous(),
              "block_tables must be a contiguous [R, W] int64 tensor");
  for (const torch::Tensor* t : {&temperature, &top_p, &min_p}) {
    TORCH_CHECK(t->dim() == 1 && t->numel() == requests && t->scalar_type() == torch::kFloat32 &&
                    t->is_contiguous(),
                "temperature, top_p and min_p must be contiguous [", requests, "] float32 tensors");
  }
  check_int64s(top_k, requests, "top_k");
  TORCH_CHECK(uniforms.dim() == 2 && uniforms.size(0) == requests && uniforms.size(1) == max_depth &&
                  uniforms.scalar_type() == torch::kFloat64 && uniforms.is_contiguous(),
              "uniforms must be a contiguous [", requests, ", ", max_depth, "] float64 tensor");
  const float* temperatures = temperature.data_ptr<float>();
  const bool sampled = std::any_of(temperatures, temperatures + requests, [](float t) { return t > 0.0f; });
  const int64_t width = vocab_.numel();
  // q of every draft, [R, D, N] (zero past a request's depth); none when every request is greedy.
  auto q = sampled ? torch::zeros({requests, max_depth, width}, torch::kFloat32)
                   : torch::empty({0}, torch::kFloat32);
  std::vector<float> sorted;
  // The columns drafted at position s for the requests of `picked_rows` (rows of `logits` in order).
  auto choose = [&](const torch::Tensor& logits, const std::vector<int64_t>& picked_rows, int64_t s) {
    if (!sampled) return first_maxima(logits);
    std::vector<int64_t> columns(picked_rows.size());
    for (size_t a = 0; a < picked_rows.size(); ++a) {
      const int64_t r = picked_rows[a];
      columns[a] = pick(logits.data_ptr<float>() + a * width, width, temperatures[r],
                        top_k.data_ptr<int64_t>()[r], top_p.data_ptr<float>()[r],
                        min_p.data_ptr<float>()[r], uniforms.data_ptr<double>()[r * max_depth + s],
                        q.data_ptr<float>() + (r * max_depth + s) * width, sorted);
    }
    return columns;
  };
  const int64_t dim = cos.size(-1);
  const int64_t* vocab = vocab_.data_ptr<int64_t>();
  const float* table = vocab_embeddings_.data_ptr<float>();
  QuantizedRows quantized;

  // The first pass: the catch-up rows' features (each layer at unit RMS, then fuse), fc over
  // [embedding, feature], the layer.
  std::vector<float> unit(rows * layers_in), features(rows * d);
  const float* src = inputs.data_ptr<float>();
  for (int64_t k = 0; k < rows * fused_layers_; ++k) {
    rms_norm_row(src + k * d, unit.data() + k * d, ones_.data_ptr<float>(), d, eps_);
  }
  project_rows(fuse_, unit.data(), rows, layers_in, kCompiled, layer.kernel(), layer.f32_isa(),
               quantized, features.data());
  std::vector<float> joined(rows * 2 * d);
  for (int64_t t = 0; t < rows; ++t) {
    std::copy_n(embeddings.data_ptr<float>() + t * d, d, joined.data() + t * 2 * d);
    std::copy_n(features.data() + t * d, d, joined.data() + t * 2 * d + d);
  }
  auto hidden = torch::empty({rows, d}, torch::kFloat32);
  project_rows(fc_, joined.data(), rows, 2 * d, kCompiled, layer.kernel(), layer.f32_isa(),
               quantized, hidden.data_ptr<float>());
  // Only a request's last catch-up row has an output anybody reads (its logits, its predicted
  // feature); the rows before it are there for their keys and values alone, so they skip the
  // attention, the output projection and the MLP, ~60 % of a row's products (a long-idle
  // request's probe catches up on every position it skipped).
  const int64_t* last = logits_rows.data_ptr<int64_t>();
  std::vector<bool> read(rows, false);
  for (int64_t r = 0; r < requests; ++r) {
    TORCH_CHECK(0 <= last[r] && last[r] < rows, "logits_rows[", r, "]=", last[r],
                " is not within [0, ", rows, ")");
    read[last[r]] = true;
  }
  std::vector<int64_t> unread;
  for (int64_t t = 0; t < rows; ++t) {
    if (!read[t]) unread.push_back(t);
  }
  const torch::Tensor first_cos = cos.narrow(0, 0, rows), first_sin = sin.narrow(0, 0, rows);
  const torch::Tensor first_slots = slots.narrow(0, 0, rows);
  if (!unread.empty()) {
    const torch::Tensor index = int64s(unread);
    layer.write_keys_values(hidden.index_select(0, index), 0, first_cos.index_select(0, index),
                            first_sin.index_select(0, index), kv_caches,
                            first_slots.index_select(0, index), first_products.at(0));
  }
  std::vector<torch::Tensor> plan = first_plan;
  for (size_t k = 1; k < plan.size(); ++k) plan[k] = plan[k].index_select(0, logits_rows);
  hidden = hidden.index_select(0, logits_rows);  // [R, d]: request r's last row
  layer.forward(hidden, 0, 1, {first_cos.index_select(0, logits_rows)},
                {first_sin.index_select(0, logits_rows)}, kv_caches,
                first_slots.index_select(0, logits_rows), {plan}, chain_products, {}, {});
  std::vector<int64_t> everyone(requests);
  for (int64_t r = 0; r < requests; ++r) everyone[r] = r;
  std::vector<int64_t> column =
      choose(layer.logits(hidden, torch::arange(requests, torch::kInt64), head_product), everyone, 0);

  auto drafts = torch::full({requests, max_depth}, -1, torch::kInt64);
  int64_t* out = drafts.data_ptr<int64_t>();
  // Per request, its predicted feature: the row of its latest pass.
  std::vector<float> predicted(hidden.data_ptr<float>(), hidden.data_ptr<float>() + requests * d);
  for (int64_t r = 0; r < requests; ++r) out[r * max_depth] = vocab[column[r]];

  // Later positions: one row per request still drafting.
  const int64_t* start = chain_start.data_ptr<int64_t>();
  for (int64_t s = 1; s < max_depth; ++s) {
    std::vector<int64_t> active;
    for (int64_t r = 0; r < requests; ++r) {
      if (depth[r] > s) active.push_back(r);
    }
    const int64_t count = static_cast<int64_t>(active.size());
    std::vector<int64_t> row_slots(count), visible(count), positions(count);
    auto step_cos = torch::empty({count, 1, dim}, torch::kFloat32);
    auto step_sin = torch::empty({count, 1, dim}, torch::kFloat32);
    joined.resize(count * 2 * d);
    const int64_t base = rows + (s - 1) * requests;
    for (int64_t a = 0; a < count; ++a) {
      const int64_t r = active[a];
      std::copy_n(table + column[r] * d, d, joined.data() + a * 2 * d);
      std::copy_n(predicted.data() + r * d, d, joined.data() + a * 2 * d + d);
      std::copy_n(cos.data_ptr<float>() + (base + r) * dim, dim, step_cos.data_ptr<float>() + a * dim);
      std::copy_n(sin.data_ptr<float>() + (base + r) * dim, dim, step_sin.data_ptr<float>() + a * dim);
      row_slots[a] = slots.data_ptr<int64_t>()[base + r];
      positions[a] = start[r] + s - 1;
      visible[a] = positions[a] + 1;
    }
    hidden = torch::empty({count, d}, torch::kFloat32);
    project_rows(fc_, joined.data(), count, 2 * d, kCompiled, layer.kernel(), layer.f32_isa(),
                 quantized, hidden.data_ptr<float>());
    const std::vector<torch::Tensor> plan = {
        block_tables, int64s(active), torch::zeros({count}, torch::kInt64), int64s(visible),
        int64s(positions), torch::zeros({count, 0}, torch::kBool)};
    layer.forward(hidden, 0, 1, {step_cos}, {step_sin}, kv_caches, int64s(row_slots), {plan},
                  chain_products, {}, {});
    const torch::Tensor every = torch::arange(count, torch::kInt64);
    const std::vector<int64_t> picked = choose(layer.logits(hidden, every, head_product), active, s);
    for (int64_t a = 0; a < count; ++a) {
      const int64_t r = active[a];
      column[r] = picked[a];
      out[r * max_depth + s] = vocab[picked[a]];
      std::copy_n(hidden.data_ptr<float>() + a * d, d, predicted.data() + r * d);
    }
  }
  return {drafts, q};
}

}  // namespace verispec
