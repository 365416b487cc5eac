// Attention of a few query rows per sequence against a paged KV cache, each (row, head)
// computed on its own in a fixed order: a row's result does not depend on the other rows in
// the batch, which keeps greedy speculative decoding on quantized weights (whose int8
// activations magnify any difference) equal to plain decoding token for token.
#pragma once
#include <torch/extension.h>

#include <vector>

namespace verispec {

// Where each query row attends (the tensors of paged_attention_rows below, as raw pointers;
// the tensors must outlive it).
struct RowPlan {
  const int64_t* block_tables;  // [B, table_width]
  int64_t table_width;
  const int64_t* row_seq;         // [R]
  const int64_t* row_first;       // [R]
  const int64_t* row_visible;     // [R]
  const int64_t* row_tree_start;  // [R]
  const bool* tree_mask;          // [R, max_new]
  int64_t max_new;

  // From [block_tables, row_seq, row_first, row_visible, row_tree_start, tree_mask], checked.
  static RowPlan of(const std::vector<torch::Tensor>& tensors);
};

// paged_attention_rows on raw rows: query row r, head h at q + r * q_stride + h * dim; the
// result of row r at out + r * heads * dim.
void attend_rows(const float* q, int64_t q_stride, int64_t rows, int64_t heads, int64_t dim,
                 const torch::Tensor& kv_cache, const RowPlan& plan, float scale, float softcap,
                 float* out);

// q [R, Hq, D] float32; kv_cache [2, blocks, block_size, Hkv, D] float32 or float16 (widened
// exactly on read);
// block_tables [B, max_blocks] int64; row_seq [R] int64 (row -> block table row);
// row_first [R] int64 and row_visible [R] int64 (positions row_first .. row_visible - 1 are
// attended; row_first > 0 under a sliding window);
// row_tree_start [R] int64 and tree_mask [R, max_new] bool: positions row_tree_start + j with
// tree_mask[r, j], if at or after row_first, are attended too (tree rows; tree_mask may have
// 0 columns). Scores are q . k * scale, then softcap * tanh(score / softcap) when softcap > 0.
// Returns [R, Hq * D].
torch::Tensor paged_attention_rows(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                   const torch::Tensor& block_tables, const torch::Tensor& row_seq,
                                   const torch::Tensor& row_first,
                                   const torch::Tensor& row_visible,
                                   const torch::Tensor& row_tree_start,
                                   const torch::Tensor& tree_mask, double scale, double softcap);

}  // namespace verispec
