// Drafting of a compiled fused EAGLE head (verispec/spec_decode/eagle.py, EagleDrafter) as
// one call: the catch-up rows' features (the projection of the target's layers read), the
// head's first pass over them, and every later draft position (one row per request: the last
// draft's embedding beside its predicted feature through fc, the decoder layer, the norm and the
// LM head over the draft vocabulary, the first maximum or a draw from the request's filtered
// distribution) without returning to Python. From
// Python, a one-position call of the 4-bit embedded model's head spent about half its time
// between the products, and each later position ~0.2 ms more.
#pragma once
#include <torch/extension.h>

#include <vector>

#include "decoder.h"

namespace verispec {

class EagleChain {
 public:
  // linears: {"fc": (parts, bias) [2 d -> d], "fuse": (parts, bias) [n d -> d]};
  // fused_layers: n >= 1, the target layers the head reads; vocab_embeddings [N, d] float32: the
  // target's input embedding of each draft column's token; vocab [N] int64: each column's
  // token; eps: the unit norm's of each layer read.
  EagleChain(const pybind11::dict& linears, int64_t fused_layers, torch::Tensor vocab_embeddings,
             torch::Tensor vocab, double eps);

  // [drafts, q]: drafts [R, D] int64, each request's drafts (-1 past its depth); q [R, D, N]
  // float32, the distribution each was drawn from (zeros past a request's depth), or an empty
  // tensor when every request is greedy (its drafts the first maxima, q never read).
  // stack: the head's decoder layer, built with its output norm and LM head (has_head);
  // inputs [T, n d] float32: the catch-up rows' target hidden states;
  // embeddings [T, d] float32: the target's embedding of each catch-up row's token;
  // cos, sin [T + (D - 1) R, 1, head_dim] (RotaryEmbedding.angles): the T rows, then per later
  // position s = 1 .. D - 1 (D = max depth) a row per request; slots [T + (D - 1) R] int64 the
  // same rows' cache slots (rows past a request's depth are not read);
  // first_plan: the first pass's 6 RowPlan tensors; logits_rows [R] int64: each request's last
  // catch-up row; block_tables [R, W] int64 and chain_start [R] int64 (the position of each
  // request's first later row) plan the later positions; depths [R] int64 >= 1;
  // first_products: DecoderStack.forward's products at T rows (of which qkv's runs the rows
  // before each request's last, whose keys and values alone are computed); chain_products:
  // at R rows (each request's last catch-up row, then each later position);
  // head_product: the LM head's at R rows; temperature, top_p, min_p [R] float32 and top_k [R]
  // int64: each request's filters (temperature 0: greedy; top_k 0, top_p 1, min_p 0: off);
  // uniforms [R, D] float64: request r's uniform for its draft at position s (its own stream,
  // so that its drafts do not depend on the batch).
  std::vector<torch::Tensor> draft(const DecoderStack& stack, const torch::Tensor& inputs, const torch::Tensor& embeddings,
                      const torch::Tensor& cos, const torch::Tensor& sin,
                      const std::vector<torch::Tensor>& kv_caches, const torch::Tensor& slots,
                      const std::vector<torch::Tensor>& first_plan,
                      const torch::Tensor& logits_rows, const torch::Tensor& block_tables,
                      const torch::Tensor& chain_start, const torch::Tensor& depths,
                      const std::vector<int64_t>& first_products,
                      const std::vector<int64_t>& chain_products, int64_t head_product,
                      const torch::Tensor& temperature, const torch::Tensor& top_k,
                      const torch::Tensor& top_p, const torch::Tensor& min_p,
                      const torch::Tensor& uniforms) const;

 private:
  LinearLayer fc_, fuse_;
  int64_t fused_layers_;
  torch::Tensor vocab_embeddings_, vocab_, ones_;
  float eps_;
};

}  // namespace verispec
