// Sampling helpers of the verifier and the drafters (verispec/sample) on CPU tensors.
#pragma once

#include <torch/extension.h>

namespace verispec {

// One draw per row from weights / sum(weights): [B] int64, the first column whose running
// float64 sum exceeds u times the row's sum (the last column if none does). weights [B, V]
// float32 or float64, non-negative; u [B] float64 in (0, 1). The running sums are taken in
// column order, as torch's CPU cumsum takes them, so the draw is verispec.sample.ragged's
// searchsorted over that cumsum, token for token, without the [B, V] float64 copy and cumsum.
torch::Tensor inverse_cdf(const torch::Tensor& weights, const torch::Tensor& u);

// [B, width] float32: each row's `width` largest values of x [B, V] float32 (no NaN), in
// descending order: torch.topk(x, width).values, whose values do not depend on how they are
// found; ~4x faster than topk at a 49,152-wide row and width 256 (sampling.cpp).
torch::Tensor top_values(const torch::Tensor& x, int64_t width);

// verispec/sample/rng.py's streams on CPU tensors, bit for bit (its int64 splitmix64 is this
// uint64 one): request_keys(seeds [B], steps [B]) -> [B] int64, and uniform(keys [N],
// positions [N], purpose) -> [N] float64 in (0, 1). One call where torch took ~20 small ops.
torch::Tensor request_keys(const torch::Tensor& seeds, const torch::Tensor& steps);
torch::Tensor uniform(const torch::Tensor& keys, const torch::Tensor& positions, int64_t purpose);

// x [B, V] float32 with -inf where x < threshold [B] (x.masked_fill(x < threshold[:, None],
// -inf) in one pass, without the mask).
torch::Tensor fill_below(const torch::Tensor& x, const torch::Tensor& threshold);

}  // namespace verispec
