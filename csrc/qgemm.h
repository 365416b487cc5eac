// Products of float activations with weights stored as blocks of 32 unsigned 4- or 8-bit
// integers, each block with a scale d and a minimum m: w = d * q + m (GGUF's Q4_0, Q4_1, Q8_0
// and Q4_K map onto this exactly; Q4_0 and Q8_0 have no stored m: m = -zero_point * d).
//
// The activations are quantized per row and block of 32 to int8 (xq, scale xd, block sum xs),
// so each block's product is an exact integer dot product:
//   y[r, n] = sum_g d[n,g] * xd[r,g] * dot(q[n,g,:], xq[r,g,:]) + m[n,g] * (xd[r,g] * xs[r,g])
// (a zero point's m = -zero_point * d is folded into the integers: dot - zero_point * xs).
// Every row is computed by the same sequence of operations whatever the other rows are, so a
// row's result is bit-identical at any M (qgemm_kernel.inc lists the operations).
//
// Weights are stored in panels of 16 columns (verispec/model/quant/formats.py, PanelWeight):
// for panel p and block g, the four bytes q[n, g, 4k .. 4k+3] of its 16 columns n lie side by
// side, so one 512-bit integer dot product of those 64 bytes with four activation bytes
// broadcast gives each column's partial sum in its own lane, with no horizontal reduction (a
// 256-bit one does the same for either half, 8 columns):
// - bits 8: chunk k = 0..7 of 64 bytes each (column-major within the chunk);
// - bits 4: four chunks j = 0..3 of 64 bytes, the low nibbles holding elements 4j .. 4j+3 and the
//   high nibbles elements 16+4j .. 16+4j+3.
// Scales d and m are [panels, K / 32, 16]; padding columns have q = d = m = 0.
#pragma once
#include <cstdint>

namespace verispec {

constexpr int64_t kPanel = 16;
constexpr int64_t kChunk = 4 * kPanel;  // bytes of a panel chunk (above)
// How far ahead of the block being multiplied every variant fetches its weights: the hardware's
// stream prefetch alone leaves a multi-row tile waiting on memory (measured 10-15% slower at
// M = 1..8 on AMD Zen 4; 1 and 4 KB ahead measured close to 2 KB). Past the weights' end it
// names addresses no load reads: a prefetch never faults (an integer address, no pointer formed).
constexpr int64_t kPrefetch = 2048;

struct QGemmArgs {
  int64_t M, N, K;        // K a multiple of 32; N the real columns (panels hold ceil(N / 16) * 16)
  const int8_t* xq;       // [M, K]
  const float* xd;        // [M, K / 32]
  const float* xm;        // [M, K / 32] xd * xs
  const int32_t* xs;      // [M, K / 32] sum of the block's xq
  const uint8_t* w;       // [ceil(N / 16), K / 32, 16 * 32 * bits / 8] panels (above)
  const void* d;          // [ceil(N / 16), K / 32, 16] float16 (uint16_t bits) or float32
  const void* m;          // like d, or null: m = -zero_point * d
  int bits;               // 4 or 8
  bool scales_fp32;
  int zero_point;
  float* y;               // [M, ldy], columns [0, N) written
  int64_t ldy;
};

// Panels [p0, p1) of y, one function per instruction set (qgemm_<isa>.cpp).
void qgemm_amx(const QGemmArgs& a, int64_t p0, int64_t p1);
void qgemm_avx512vnni(const QGemmArgs& a, int64_t p0, int64_t p1);
void qgemm_avx512bw(const QGemmArgs& a, int64_t p0, int64_t p1);
void qgemm_avxvnni(const QGemmArgs& a, int64_t p0, int64_t p1);
void qgemm_avx2(const QGemmArgs& a, int64_t p0, int64_t p1);
void qgemm_generic(const QGemmArgs& a, int64_t p0, int64_t p1);

}  // namespace verispec
