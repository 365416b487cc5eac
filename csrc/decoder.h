// The decoder layers of a quantized or CPU float32 model (verispec/model/llama.py,
// DecoderLayer) as one C++ call per forward pass. A batch-1 step of the embedded 4-bit model ran
// ~76 torch operations per layer from Python, about half of its time; here the norms, rotary
// embeddings, cache writes, activations and residual additions are plain loops between the
// products (quantized weights: qlinear.h; float32 weights: f32linear.h or torch's BLAS, as the
// caller picks) and the row-by-row attention (attention.h).
//
// Every row is computed on its own in a fixed order (norms, activations, products, attention),
// so a row's result does not depend on the other rows: the batch invariance the quantized path
// promises (greedy speculative output equal to plain output token for token). Float32 weights
// keep it where the caller picks the compiled product (f32linear.h) for every row count run.
#pragma once
#include <torch/extension.h>

#include <string>
#include <vector>

#include "attention.h"
#include "f32linear.h"
#include "qlinear.h"

namespace verispec {

// y = x W^T (+ bias) with W stored as row blocks ("parts"), each in panels, or as one dense
// float32 weight.
struct LinearLayer {
  std::vector<Panels> parts;
  torch::Tensor dense;  // [out, in] float32 contiguous, or undefined (then parts)
  torch::Tensor bias;  // [out] float32, or undefined
  int64_t in = 0, out = 0;
};

// How a dense product runs, chosen by the caller per call (verispec.model.linear.stack_product):
// kCompiled: f32_linear; kLinear: torch's mm(x, W^T), F.linear's product; a count p > 0: the
// skinny product mm(W, x^T) over x padded with zero rows to p rows.
constexpr int64_t kCompiled = -1, kLinear = 0;

struct LayerWeights {
  // Norm weights [2 * width] float32 as the Python model keeps them ([w, w]; the first half is
  // read), undefined where the family has none.
  torch::Tensor input_norm, post_attention_norm, attn_out_norm, mlp_out_norm, q_norm, k_norm;
  LinearLayer qkv, o, gate_up, down;
  int64_t rope = 0;  // index into forward's cos / sin
  int64_t plan = 0;  // index into forward's plans
};

// The linear layer described by spec[key]: (parts, bias) as DecoderStack's layers take them.
LinearLayer linear_from(const pybind11::dict& spec, const char* key);

// y [rows, out] = x [rows, in] times the layer's weight transposed, plus its bias (quantized
// parts: x quantized once into `scratch`; a dense weight: as `product` says).
void project_rows(const LinearLayer& linear, const float* x, int64_t rows, int64_t in,
                  int64_t product, Kernel kernel, const std::string& isa, QuantizedRows& scratch,
                  float* y);

class DecoderStack {
 public:
  // layers: one dict per layer (keys as LayerWeights' fields; a linear is (parts, bias), parts
  // a list of (packed, d, m, bits, zero_point, n) or a dense [out, in] float32 tensor); scale:
  // of the attention scores; softcap <= 0: none;
  // head: None, or the final norm and the LM head, {"norm": [2 * hidden], "lm_head": a linear}.
  DecoderStack(const std::vector<pybind11::dict>& layers, int64_t heads, int64_t kv_heads,
               int64_t head_dim, int64_t intermediate, double eps, bool gelu, double scale,
               double softcap, const std::string& isa, const pybind11::object& head);

  // Layers [begin, end) over hidden [T, hidden_size] float32, updated in place.
  // cos, sin: per rope index [T, 1, head_dim] (RotaryEmbedding.angles, sin sign-folded);
  // kv_caches: per layer (all of them) [2, blocks, block_size, kv_heads, head_dim];
  // slot_mapping [T] int64; plans: per plan index the 6 tensors of RowPlan::of, every row of T
  // in order; products: how the dense weights' products run at T rows (kCompiled, kLinear or
  // a padded count), for qkv, o, gate_up and down (quantized parts ignore it).
  // capture_after: layer numbers n, begin < n < end, in increasing order; captured[j] [T,
  // hidden_size] float32 receives hidden as it is after layer number capture_after[j] (the
  // layers before index n), the hidden states a learned drafter reads, within this one call:
  // a call per captured layer cost a 4-bit step ~4 % at batch 1 (the threads' wake-ups and
  // the arguments' conversion each time).
  void forward(torch::Tensor hidden, int64_t begin, int64_t end,
               const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin,
               const std::vector<torch::Tensor>& kv_caches, const torch::Tensor& slot_mapping,
               const std::vector<std::vector<torch::Tensor>>& plans,
               const std::vector<int64_t>& products, const std::vector<int64_t>& capture_after,
               const std::vector<torch::Tensor>& captured) const;

  // Layer `index`'s keys and values of hidden [T, hidden_size] (its input) written to its cache
  // at slot_mapping [T], as forward writes them, and nothing else computed: for rows whose
  // outputs nobody reads (a learned head's catch-up rows before each request's last, which
  // later rows attend to). cos, sin [T, 1, head_dim]; product: as forward's for qkv at T rows.
  void write_keys_values(const torch::Tensor& hidden, int64_t index, const torch::Tensor& cos,
                         const torch::Tensor& sin, const std::vector<torch::Tensor>& kv_caches,
                         const torch::Tensor& slot_mapping, int64_t product) const;

  // [R, vocab] float32: the LM head's logits of rows `indices` [R] int64 of hidden [T,
  // hidden_size] after the final norm (one call where torch took eight operations); product:
  // as forward's, for a dense LM head at R rows.
  torch::Tensor logits(const torch::Tensor& hidden, const torch::Tensor& indices,
                       int64_t product) const;

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  bool has_head() const { return final_norm_.defined(); }
  Kernel kernel() const { return kernel_; }
  const std::string& f32_isa() const { return f32_isa_; }

 private:
  // Rows [rows] of h after layer w's input norm (into x) and their queries, keys and values
  // (into qkv [rows, (heads + 2 kv_heads) head_dim], normed and rotated), the keys and values
  // written to `cache` at `slots`.
  void queries_keys_values(const LayerWeights& w, const float* h, int64_t rows, int64_t width,
                           int64_t product, const float* cos, const float* sin,
                           const torch::Tensor& cache, const int64_t* slots,
                           QuantizedRows& quantized, float* x, float* qkv) const;

  std::vector<LayerWeights> layers_;
  torch::Tensor final_norm_;  // [2 * hidden] float32, undefined without a head
  LinearLayer lm_head_;
  int64_t heads_, kv_heads_, head_dim_, intermediate_;
  float eps_, scale_, softcap_;
  bool gelu_;
  Kernel kernel_;
  std::string f32_isa_;  // f32_isas()' best
};

}  // namespace verispec
