// The decoder layers of a quantized model (verispec/model/llama.py, DecoderLayer) as one C++
// call per forward pass. A batch-1 step of the embedded model ran ~76 torch operations per layer
// from Python, about half of its time; here the norms, rotary embeddings, cache writes,
// activations and residual additions are plain loops between the quantized products
// (qlinear.h) and the row-by-row attention (attention.h).
//
// Every row is computed on its own in a fixed order (norms, activations, products, attention),
// so a row's result does not depend on the other rows: the batch invariance the quantized path
// promises (greedy speculative output equal to plain output token for token).
#pragma once
#include <torch/extension.h>

#include <string>
#include <vector>

#include "attention.h"
#include "qlinear.h"

namespace verispec {

// y = x W^T (+ bias) with W stored as row blocks ("parts"), each in panels.
struct LinearLayer {
  std::vector<Panels> parts;
  torch::Tensor bias;  // [out] float32, or undefined
  int64_t in = 0, out = 0;
};

struct LayerWeights {
  // Norm weights [2 * width] float32 as the Python model keeps them ([w, w]; the first half is
  // read), undefined where the family has none.
  torch::Tensor input_norm, post_attention_norm, attn_out_norm, mlp_out_norm, q_norm, k_norm;
  LinearLayer qkv, o, gate_up, down;
  int64_t rope = 0;  // index into forward's cos / sin
  int64_t plan = 0;  // index into forward's plans
};

class DecoderStack {
 public:
  // layers: one dict per layer (keys as LayerWeights' fields; a linear is (parts, bias), a part
  // (packed, d, m, bits, zero_point, n)); scale: of the attention scores; softcap <= 0: none;
  // head: None, or the final norm and the LM head, {"norm": [2 * hidden], "lm_head": a linear}.
  DecoderStack(const std::vector<pybind11::dict>& layers, int64_t heads, int64_t kv_heads,
               int64_t head_dim, int64_t intermediate, double eps, bool gelu, double scale,
               double softcap, const std::string& isa, const pybind11::object& head);

  // Layers [begin, end) over hidden [T, hidden_size] float32, updated in place.
  // cos, sin: per rope index [T, 1, head_dim] (RotaryEmbedding.angles, sin sign-folded);
  // kv_caches: per layer (all of them) [2, blocks, block_size, kv_heads, head_dim];
  // slot_mapping [T] int64; plans: per plan index the 6 tensors of RowPlan::of, every row of T
  // in order.
  void forward(torch::Tensor hidden, int64_t begin, int64_t end,
               const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin,
               const std::vector<torch::Tensor>& kv_caches, const torch::Tensor& slot_mapping,
               const std::vector<std::vector<torch::Tensor>>& plans) const;

  // [R, vocab] float32: the LM head's logits of rows `indices` [R] int64 of hidden [T,
  // hidden_size] after the final norm (one call where torch took eight operations).
  torch::Tensor logits(const torch::Tensor& hidden, const torch::Tensor& indices) const;

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  bool has_head() const { return final_norm_.defined(); }

 private:
  std::vector<LayerWeights> layers_;
  torch::Tensor final_norm_;  // [2 * hidden] float32, undefined without a head
  LinearLayer lm_head_;
  int64_t heads_, kv_heads_, head_dim_, intermediate_;
  float eps_, scale_, softcap_;
  bool gelu_;
  Kernel kernel_;
};

}  // namespace verispec
