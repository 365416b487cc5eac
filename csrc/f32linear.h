// The float32 product y = x W^T for a few rows, read at the memory's pace: each weight row is
// loaded once per task and multiplied with up to eight activation rows held in cache, where
// BLAS re-reads the weights or pads the rows (a 6-row verify step of the embedded float32 model
// cost 2.1x a one-row step with MKL's products).
//
// Every output element is the same sequence of operations whatever the other rows, columns or
// instruction set: sixteen running sums (sum l takes the elements k = l mod 16, in increasing k,
// by fused multiply-adds), then the fixed tree (s[l] + s[l+8], + [l+4], + [l+2], + [l+1]). So a
// row's result does not depend on the batch, and the AVX-512, AVX2 and portable paths agree bit
// for bit.
#pragma once
#include <torch/extension.h>

#include <string>

namespace verispec {

// The instruction sets f32_linear runs here, best first: "avx512", "avx2", "generic"
// (VERISPEC_CPU_KERNEL=generic keeps only the last).
std::vector<std::string> f32_isas();

// y [m, n] (row stride n) = x [m, k] times w [n, k] transposed, on torch's threads.
void f32_linear(const float* x, int64_t m, int64_t k, const float* w, int64_t n, float* y,
                const std::string& isa);

}  // namespace verispec
