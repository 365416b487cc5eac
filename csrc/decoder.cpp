#include "decoder.h"
#include "vecmath.h"

#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>

namespace verispec {
namespace {

namespace py = pybind11;

torch::Tensor optional_tensor(const py::dict& layer, const char* key) {
  const py::object value = layer[key];
  return value.is_none() ? torch::Tensor() : value.cast<torch::Tensor>();
}

LinearLayer linear_of(const py::dict& layer, const char* key) {
  const auto spec = layer[key].cast<py::tuple>();
  LinearLayer linear;
  if (THPVariable_Check(spec[0].ptr())) {
    linear.dense = spec[0].cast<torch::Tensor>();
    TORCH_CHECK(linear.dense.dim() == 2 && linear.dense.scalar_type() == torch::kFloat32 &&
                    linear.dense.is_contiguous(),
                key, "'s dense weight must be a contiguous [out, in] float32 tensor");
    linear.out = linear.dense.size(0);
    linear.in = linear.dense.size(1);
  } else {
    for (const py::handle& item : spec[0].cast<py::list>()) {
      const auto part = item.cast<py::tuple>();
      linear.parts.push_back(Panels{part[0].cast<torch::Tensor>(), part[1].cast<torch::Tensor>(),
                                    part[2].is_none() ? torch::Tensor() : part[2].cast<torch::Tensor>(),
                                    part[3].cast<int64_t>(), part[4].cast<int64_t>(),
                                    part[5].cast<int64_t>()});
      linear.out += linear.parts.back().n;
    }
  }
  if (!spec[1].is_none()) linear.bias = spec[1].cast<torch::Tensor>();
  return linear;
}

void check_linear(const LinearLayer& linear, int64_t in, int64_t out, const char* name) {
  TORCH_CHECK(linear.out == out, name, " has ", linear.out, " output columns: expected ", out);
  TORCH_CHECK(!linear.dense.defined() || linear.in == in, name, " takes ", linear.in,
              " input columns: expected ", in);
  for (const Panels& part : linear.parts) part.check(in);
  TORCH_CHECK(!linear.bias.defined() || (linear.bias.scalar_type() == torch::kFloat32 &&
                                         linear.bias.is_contiguous() && linear.bias.numel() == out),
              name, "'s bias must be contiguous float32 [", out, "]");
}

void check_norm(const torch::Tensor& weight, int64_t width, const char* name) {
  TORCH_CHECK(!weight.defined() || (weight.scalar_type() == torch::kFloat32 &&
                                    weight.is_contiguous() && weight.numel() == 2 * width),
              name, " must be contiguous float32 [", 2 * width, "]");
}

void check_angles(const torch::Tensor& t, int64_t rows, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.numel() == rows * dim,
              "cos and sin must be contiguous float32 [T, 1, head_dim]");
}

void check_slots(const torch::Tensor& slot_mapping, int64_t rows) {
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == rows,
              "slot_mapping must be a contiguous [T] int64 tensor");
}

void check_cache(const torch::Tensor& cache, int64_t layer, int64_t kv_heads, int64_t dim) {
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous() && cache.size(3) == kv_heads &&
                  cache.size(4) == dim &&
                  (cache.scalar_type() == torch::kHalf || cache.scalar_type() == torch::kFloat32),
              "kv_caches[", layer, "] must be contiguous [2, blocks, block_size, ", kv_heads, ", ",
              dim, "] float16 or float32");
}

void check_product(int64_t product, int64_t rows) {
  TORCH_CHECK(product == kCompiled || product == kLinear || product >= rows, "product ",
              product, " cannot run ", rows, " rows");
}

// y [rows, out] = x [rows, in] times the dense weight transposed, as `product` says (decoder.h).
void dense_product(const LinearLayer& linear, const float* x, int64_t rows, int64_t product,
                   const std::string& isa, float* y) {
  const float* w = linear.dense.data_ptr<float>();
  if (product == kCompiled) return f32_linear(x, rows, linear.in, w, linear.out, y, isa);
  RECORD_USER_SCOPE("verispec::product");
  const auto options = torch::TensorOptions().dtype(torch::kFloat32);
  const auto xs = torch::from_blob(const_cast<float*>(x), {rows, linear.in}, options);
  auto ys = torch::from_blob(y, {rows, linear.out}, options);
  if (product == kLinear) {
    at::mm_out(ys, xs, linear.dense.t());
    return;
  }
  // Real zero rows: BLAS takes a slow path for expanded (stride-0) ones.
  auto padded = torch::zeros({product, linear.in}, options);
  padded.narrow(0, 0, rows).copy_(xs);
  ys.copy_(at::mm(linear.dense, padded.t()).narrow(1, 0, rows).t());
}

// y [rows, out] = x [rows, in] times the layer's weight transposed, plus the bias: quantized
// parts take x quantized once (into `scratch`), side by side in y; a dense weight `product`.
void project(const LinearLayer& linear, const float* x, int64_t rows, int64_t in,
             int64_t product, Kernel kernel, const std::string& isa, QuantizedRows& scratch,
             float* y) {
  if (linear.dense.defined()) {
    dense_product(linear, x, rows, product, isa, y);
  } else {
    scratch.quantize(x, rows, in);
    int64_t column = 0;
    for (const Panels& part : linear.parts) {
      qlinear_into(scratch, part, kernel, y + column, linear.out);
      column += part.n;
    }
  }
  if (!linear.bias.defined()) return;
  const float* bias = linear.bias.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < linear.out; ++c) y[r * linear.out + c] += bias[c];
  }
}

void rms_norm_rows(const float* src, float* dst, const torch::Tensor& weight, int64_t rows,
                   int64_t width, int64_t stride, float eps) {
  const float* w = weight.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) rms_norm_row(src + r * stride, dst + r * stride, w, width, eps);
}

// x * cos + [x2, x1] * sin over one head (sin carries rotate_half's sign).
void rotate_head(float* x, const float* cos, const float* sin, int64_t dim, float* scratch) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < dim; ++d) scratch[d] = x[d];
  for (int64_t d = 0; d < dim; ++d) {
    x[d] = scratch[d] * cos[d] + scratch[d < half ? d + half : d - half] * sin[d];
  }
}

// src as float16, rounded to nearest even (c10::Half, or F16C eight at a time: the same bits).
__attribute__((target("avx2,f16c"))) void to_half_f16c(const float* src, c10::Half* dst,
                                                       int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i half = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), half);
  }
  for (; i < n; ++i) dst[i] = c10::Half(src[i]);
}

void store(const float* src, c10::Half* dst, int64_t n) {
  if (use_avx2_f16c()) return to_half_f16c(src, dst, n);
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::Half(src[i]);
}

void store(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }

// Keys and values of every new row into their slots: [2, blocks, block_size, kv_heads, dim].
template <typename T>
void write_cache(const float* qkv, int64_t width, int64_t rows, int64_t heads, int64_t kv_heads,
                 int64_t dim, const int64_t* slots, T* cache, int64_t values_offset) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* keys = qkv + r * width + heads * dim;
    T* key_dst = cache + slots[r] * kv_heads * dim;
    store(keys, key_dst, kv_heads * dim);
    store(keys + kv_heads * dim, key_dst + values_offset, kv_heads * dim);
  }
}

}  // namespace

LinearLayer linear_from(const py::dict& spec, const char* key) { return linear_of(spec, key); }

void project_rows(const LinearLayer& linear, const float* x, int64_t rows, int64_t in,
                  int64_t product, Kernel kernel, const std::string& isa, QuantizedRows& scratch,
                  float* y) {
  project(linear, x, rows, in, product, kernel, isa, scratch, y);
}

DecoderStack::DecoderStack(const std::vector<py::dict>& layers, int64_t heads, int64_t kv_heads,
                           int64_t head_dim, int64_t intermediate, double eps, bool gelu,
                           double scale, double softcap, const std::string& isa,
                           const py::object& head)
    : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), intermediate_(intermediate),
      eps_(static_cast<float>(eps)), scale_(static_cast<float>(scale)),
      softcap_(static_cast<float>(softcap)), gelu_(gelu), kernel_(kernel_for(isa)),
      f32_isa_(f32_isas().front()) {
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim % 2 == 0,
              "heads=", heads, ", kv_heads=", kv_heads, ", head_dim=", head_dim, " are invalid");
  for (const py::dict& layer : layers) {
    LayerWeights w;
    w.input_norm = optional_tensor(layer, "input_norm");
    w.post_attention_norm = optional_tensor(layer, "post_attention_norm");
    w.attn_out_norm = optional_tensor(layer, "attn_out_norm");
    w.mlp_out_norm = optional_tensor(layer, "mlp_out_norm");
    w.q_norm = optional_tensor(layer, "q_norm");
    w.k_norm = optional_tensor(layer, "k_norm");
    w.qkv = linear_of(layer, "qkv");
    w.o = linear_of(layer, "o");
    w.gate_up = linear_of(layer, "gate_up");
    w.down = linear_of(layer, "down");
    w.rope = layer["rope"].cast<int64_t>();
    w.plan = layer["plan"].cast<int64_t>();
    TORCH_CHECK(w.input_norm.defined() && w.post_attention_norm.defined(),
                "every layer needs input_norm and post_attention_norm");
    const int64_t hidden = w.input_norm.numel() / 2;
    check_norm(w.input_norm, hidden, "input_norm");
    check_norm(w.post_attention_norm, hidden, "post_attention_norm");
    check_norm(w.attn_out_norm, hidden, "attn_out_norm");
    check_norm(w.mlp_out_norm, hidden, "mlp_out_norm");
    check_norm(w.q_norm, head_dim, "q_norm");
    check_norm(w.k_norm, head_dim, "k_norm");
    check_linear(w.qkv, hidden, (heads + 2 * kv_heads) * head_dim, "qkv");
    check_linear(w.o, heads * head_dim, hidden, "o");
    check_linear(w.gate_up, hidden, 2 * intermediate, "gate_up");
    check_linear(w.down, intermediate, hidden, "down");
    layers_.push_back(std::move(w));
  }
  if (!head.is_none()) {
    const auto spec = head.cast<py::dict>();
    final_norm_ = spec["norm"].cast<torch::Tensor>();
    lm_head_ = linear_of(spec, "lm_head");
    const int64_t hidden = final_norm_.numel() / 2;
    check_norm(final_norm_, hidden, "norm");
    check_linear(lm_head_, hidden, lm_head_.out, "lm_head");
  }
}

void DecoderStack::queries_keys_values(const LayerWeights& w, const float* h, int64_t rows,
                                       int64_t width, int64_t product, const float* cos,
                                       const float* sin, const torch::Tensor& cache,
                                       const int64_t* slots, QuantizedRows& quantized, float* x,
                                       float* qkv) const {
  const int64_t dim = head_dim_, qkv_width = (heads_ + 2 * kv_heads_) * dim;
  std::vector<float> scratch(dim);
  rms_norm_rows(h, x, w.input_norm, rows, width, width, eps_);
  project(w.qkv, x, rows, width, product, kernel_, f32_isa_, quantized, qkv);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = qkv + r * qkv_width;
    if (w.q_norm.defined()) {
      rms_norm_rows(row, row, w.q_norm, heads_, dim, dim, eps_);
      rms_norm_rows(row + heads_ * dim, row + heads_ * dim, w.k_norm, kv_heads_, dim, dim, eps_);
    }
    for (int64_t head = 0; head < heads_ + kv_heads_; ++head) {
      rotate_head(row + head * dim, cos + r * dim, sin + r * dim, dim, scratch.data());
    }
  }
  const int64_t values_offset = cache.numel() / 2;
  if (cache.scalar_type() == torch::kHalf) {
    write_cache(qkv, qkv_width, rows, heads_, kv_heads_, dim, slots, cache.data_ptr<c10::Half>(),
                values_offset);
  } else {
    write_cache(qkv, qkv_width, rows, heads_, kv_heads_, dim, slots, cache.data_ptr<float>(),
                values_offset);
  }
}

void DecoderStack::write_keys_values(const torch::Tensor& hidden, int64_t index,
                                     const torch::Tensor& cos, const torch::Tensor& sin,
                                     const std::vector<torch::Tensor>& kv_caches,
                                     const torch::Tensor& slot_mapping, int64_t product) const {
  TORCH_CHECK(0 <= index && index < num_layers(), "layer ", index, " is not within [0, ",
              num_layers(), ")");
  const int64_t rows = hidden.size(0), width = hidden.size(1), dim = head_dim_;
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == torch::kFloat32 &&
                  hidden.is_contiguous() && width == layers_[index].input_norm.numel() / 2,
              "hidden must be a contiguous [T, hidden_size] float32 tensor");
  check_product(product, rows);
  for (const torch::Tensor* t : {&cos, &sin}) check_angles(*t, rows, dim);
  check_slots(slot_mapping, rows);
  const torch::Tensor& cache = kv_caches.at(index);
  check_cache(cache, index, kv_heads_, dim);
  if (rows == 0) return;
  py::gil_scoped_release released;
  std::vector<float> x(rows * width), qkv(rows * (heads_ + 2 * kv_heads_) * dim);
  QuantizedRows quantized;
  queries_keys_values(layers_[index], hidden.data_ptr<float>(), rows, width, product,
                      cos.data_ptr<float>(), sin.data_ptr<float>(), cache,
                      slot_mapping.data_ptr<int64_t>(), quantized, x.data(), qkv.data());
}

void DecoderStack::forward(torch::Tensor hidden, int64_t begin, int64_t end,
                           const std::vector<torch::Tensor>& cos,
                           const std::vector<torch::Tensor>& sin,
                           const std::vector<torch::Tensor>& kv_caches,
                           const torch::Tensor& slot_mapping,
                           const std::vector<std::vector<torch::Tensor>>& plans,
                           const std::vector<int64_t>& products,
                           const std::vector<int64_t>& capture_after,
                           const std::vector<torch::Tensor>& captured) const {
  const int64_t layers = num_layers();
  TORCH_CHECK(0 <= begin && begin <= end && end <= layers, "layers [", begin, ", ", end,
              ") are not within [0, ", layers, ")");
  TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == layers, "kv_caches has ",
              kv_caches.size(), " tensors: expected one per layer (", layers, ")");
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == torch::kFloat32 &&
                  hidden.is_contiguous(),
              "hidden must be a contiguous [T, hidden_size] float32 tensor");
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  const int64_t dim = head_dim_, inter = intermediate_;
  const int64_t qkv_width = (heads_ + 2 * kv_heads_) * dim, attn_width = heads_ * dim;
  TORCH_CHECK(products.size() == 4, "products has ", products.size(),
              " entries: expected 4 (qkv, o, gate_up, down)");
  for (const int64_t product : products) check_product(product, rows);
  TORCH_CHECK(capture_after.size() == captured.size(), "capture_after has ",
              capture_after.size(), " layer numbers and captured ", captured.size(), " tensors");
  for (size_t j = 0; j < captured.size(); ++j) {
    TORCH_CHECK(begin < capture_after[j] && capture_after[j] < end &&
                    (j == 0 || capture_after[j - 1] < capture_after[j]),
                "capture_after must increase within (", begin, ", ", end, "): ", capture_after[j]);
    TORCH_CHECK(captured[j].scalar_type() == torch::kFloat32 && captured[j].is_contiguous() &&
                    captured[j].dim() == 2 && captured[j].size(0) == rows &&
                    captured[j].size(1) == width,
                "captured[", j, "] must be a contiguous [", rows, ", ", width, "] float32 tensor");
  }
  TORCH_CHECK(cos.size() == sin.size(), "cos and sin differ in length");
  for (size_t i = 0; i < cos.size(); ++i) {
    for (const torch::Tensor* t : {&cos[i], &sin[i]}) check_angles(*t, rows, dim);
  }
  check_slots(slot_mapping, rows);
  std::vector<RowPlan> row_plans;
  for (const auto& plan : plans) {
    row_plans.push_back(RowPlan::of(plan));
    TORCH_CHECK(plan[1].numel() == rows, "a plan covers ", plan[1].numel(), " rows: expected ",
                rows);
  }
  for (int64_t i = begin; i < end; ++i) {
    const LayerWeights& w = layers_[i];
    TORCH_CHECK(w.input_norm.numel() / 2 == width, "hidden has ", width,
                " columns: the layers take ", w.input_norm.numel() / 2);
    TORCH_CHECK(w.rope < static_cast<int64_t>(cos.size()) &&
                    w.plan < static_cast<int64_t>(row_plans.size()),
                "layer ", i, " needs rope ", w.rope, " and plan ", w.plan);
    check_cache(kv_caches[i], i, kv_heads_, dim);
  }
  if (rows == 0) return;

  py::gil_scoped_release released;
  float* h = hidden.data_ptr<float>();
  size_t next_capture = 0;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  std::vector<float> x(rows * width), out(rows * width), qkv(rows * qkv_width);
  std::vector<float> attn(rows * attn_width), gate_up(rows * 2 * inter), act(rows * inter);
  QuantizedRows quantized;

  for (int64_t i = begin; i < end; ++i) {
    const LayerWeights& w = layers_[i];
    const torch::Tensor& cache = kv_caches[i];

    queries_keys_values(w, h, rows, width, products[0], cos[w.rope].data_ptr<float>(),
                        sin[w.rope].data_ptr<float>(), cache, slots, quantized, x.data(), qkv.data());
    attend_rows(qkv.data(), qkv_width, rows, heads_, dim, cache, row_plans[w.plan], scale_,
                softcap_, attn.data());
    project(w.o, attn.data(), rows, attn_width, products[1], kernel_, f32_isa_, quantized,
            out.data());
    if (w.attn_out_norm.defined()) {
      rms_norm_rows(out.data(), out.data(), w.attn_out_norm, rows, width, width, eps_);
    }
    for (int64_t k = 0; k < rows * width; ++k) h[k] += out[k];

    rms_norm_rows(h, x.data(), w.post_attention_norm, rows, width, width, eps_);
    project(w.gate_up, x.data(), rows, width, products[2], kernel_, f32_isa_, quantized,
            gate_up.data());
    for (int64_t r = 0; r < rows; ++r) {
      const float* gate = gate_up.data() + r * 2 * inter;
      const float* up = gate + inter;
      float* dst = act.data() + r * inter;
      (gelu_ ? gelu_mul : silu_mul)(gate, up, dst, inter);
    }
    project(w.down, act.data(), rows, inter, products[3], kernel_, f32_isa_, quantized,
            out.data());
    if (w.mlp_out_norm.defined()) {
      rms_norm_rows(out.data(), out.data(), w.mlp_out_norm, rows, width, width, eps_);
    }
    for (int64_t k = 0; k < rows * width; ++k) h[k] += out[k];
    if (next_capture < capture_after.size() && capture_after[next_capture] == i + 1) {
      std::copy(h, h + rows * width, captured[next_capture++].data_ptr<float>());
    }
  }
}

torch::Tensor DecoderStack::logits(const torch::Tensor& hidden, const torch::Tensor& indices,
                                   int64_t product) const {
  TORCH_CHECK(has_head(), "this stack was built without the final norm and LM head");
  const int64_t width = final_norm_.numel() / 2;
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == torch::kFloat32 &&
                  hidden.is_contiguous() && hidden.size(1) == width,
              "hidden must be a contiguous [T, ", width, "] float32 tensor");
  TORCH_CHECK(indices.dim() == 1 && indices.scalar_type() == torch::kInt64 &&
                  indices.is_contiguous(),
              "indices must be a contiguous [R] int64 tensor");
  const int64_t rows = indices.numel();
  check_product(product, rows);
  const int64_t* index = indices.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(0 <= index[r] && index[r] < hidden.size(0), "row ", index[r],
                " is not within [0, ", hidden.size(0), ")");
  }
  auto y = torch::empty({rows, lm_head_.out}, hidden.options());
  if (rows == 0) return y;
  py::gil_scoped_release released;
  const float* h = hidden.data_ptr<float>();
  std::vector<float> x(rows * width);
  for (int64_t r = 0; r < rows; ++r) {
    rms_norm_rows(h + index[r] * width, x.data() + r * width, final_norm_, 1, width, width, eps_);
  }
  QuantizedRows quantized;
  project(lm_head_, x.data(), rows, width, product, kernel_, f32_isa_, quantized,
          y.data_ptr<float>());
  return y;
}

}  // namespace verispec
