// Elementwise loops of the decoder layers and the attention, compiled once per instruction set
// (vecmath.cpp: AVX-512, AVX2 and the baseline, chosen when the library loads), and the exp they
// are built on.
//
// exp_approx: exp(x) for float32 as plain arithmetic (no libm call), so that loops over it
// vectorize: the row-by-row attention's softmax weights and the decoder's SiLU take one per value. Each call
// performs the same IEEE operations in the same order whatever the instruction set the loop is
// compiled for (the extension is built with -ffp-contract=off: no fused multiply-adds), so
// results do not depend on the path or on a row's neighbours. Within 1 ulp of exp for
// x in [-87, 88] (Cephes' expf polynomial, range reduction by ln 2 split in two parts); x is
// clamped to that range, so exp(-87) ~ 1.6e-38 stands for anything smaller and exp(88) for
// anything larger (no branches: they would keep the loops from vectorizing).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

// A function compiled for AVX-512, AVX2 and the baseline, the variant picked when the library
// loads. Each performs the same IEEE operations per element (no fused multiply-adds:
// -ffp-contract=off), so results are the same on every CPU.
#define VS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

namespace verispec {

// The fixed tree eight running sums end in, wherever a sum is taken in eight lanes (dot
// products, norms, softmax totals): ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)).
inline float sum_tree(const float (&part)[8]) {
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

inline float exp_approx(float x) {
  const float clamped = std::min(std::max(x, -87.0f), 88.0f);
  // n = round(x / ln 2) by the 1.5 * 2^23 trick: the addition rounds to an integer (ties even).
  const float shifter = 12582912.0f;
  const float n = (clamped * 1.44269504088896341f + shifter) - shifter;
  const float r = (clamped - n * 0.693359375f) - n * -2.12194440e-4f;
  const float z = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = (p * z + r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// dst[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i].
void silu_mul(const float* gate, const float* up, float* dst, int64_t n);

// dst[i] = gelu_tanh(gate[i]) * up[i], GELU's tanh form (Gemma's GeGLU).
void gelu_mul(const float* gate, const float* up, float* dst, int64_t n);

// x[i] = exp(x[i] - shift).
void exp_shifted(float* x, int64_t n, float shift);

// x[i] = x[i] * scale, then cap * tanh(x[i] / cap) where cap > 0 (attention scores).
void scale_scores(float* x, int64_t n, float scale, float cap);

// The largest of x[0 .. n) (-inf for none; NaN is ignored, as fmax does).
float max_of(const float* x, int64_t n);

// x[0] + ... + x[n - 1] in eight running sums (sum j takes x[i], i = j mod 8, in order), then
// sum_tree.
float sum_in_lanes(const float* x, int64_t n);

// dst = src / sqrt(mean(src^2) + eps) * w over `width` values (dst may be src): the squares
// summed in eight running sums (sum j takes elements i = j mod 8) and a fixed tree.
void rms_norm_row(const float* src, float* dst, const float* w, int64_t width, float eps);

}  // namespace verispec
