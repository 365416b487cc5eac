#include "eagle_chain.h"

#include <algorithm>

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

void check_int64s(const torch::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.scalar_type() == torch::kInt64 && t.is_contiguous() &&
                  t.numel() == n,
              name, " must be a contiguous [", n, "] int64 tensor");
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

torch::Tensor EagleChain::draft(const DecoderStack& layer, const torch::Tensor& inputs, const torch::Tensor& embeddings,
                                const torch::Tensor& cos, const torch::Tensor& sin,
                                const std::vector<torch::Tensor>& kv_caches,
                                const torch::Tensor& slots,
                                const std::vector<torch::Tensor>& first_plan,
                                const torch::Tensor& logits_rows,
                                const torch::Tensor& block_tables,
                                const torch::Tensor& chain_start, const torch::Tensor& depths,
                                const std::vector<int64_t>& first_products,
                                const std::vector<int64_t>& chain_products,
                                int64_t head_product) const {
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
  layer.forward(hidden, 0, 1, {cos.narrow(0, 0, rows)}, {sin.narrow(0, 0, rows)}, kv_caches,
                slots.narrow(0, 0, rows), {first_plan}, first_products, {}, {});
  std::vector<int64_t> column = first_maxima(layer.logits(hidden, logits_rows, head_product));

  auto drafts = torch::full({requests, max_depth}, -1, torch::kInt64);
  int64_t* out = drafts.data_ptr<int64_t>();
  // Per request, its predicted feature: the row of its latest pass.
  std::vector<float> predicted(requests * d);
  const int64_t* last = logits_rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < requests; ++r) {
    out[r * max_depth] = vocab[column[r]];
    std::copy_n(hidden.data_ptr<float>() + last[r] * d, d, predicted.data() + r * d);
  }

  // Later positions: one row per request still drafting.
  const int64_t* start = chain_start.data_ptr<int64_t>();
  for (int64_t s = 1; s < max_depth; ++s) {
    std::vector<int64_t> active;
    for (int64_t r = 0; r < requests; ++r) {
      if (depth[r] > s) active.push_back(r);
    }
    const int64_t count = static_cast<int64_t>(active.size());
    std::vector<int64_t> row_slots(count), visible(count), positions(count), active_columns(count);
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
    const std::vector<int64_t> picked = first_maxima(layer.logits(hidden, every, head_product));
    for (int64_t a = 0; a < count; ++a) {
      const int64_t r = active[a];
      column[r] = picked[a];
      out[r * max_depth + s] = vocab[picked[a]];
      std::copy_n(hidden.data_ptr<float>() + a * d, d, predicted.data() + r * d);
    }
  }
  return drafts;
}

}  // namespace verispec
