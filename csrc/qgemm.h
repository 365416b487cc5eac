// Products of float activations with weights stored as blocks of 32 unsigned 4- or 8-bit
// integers, each block with a scale d and a minimum m: w = d * q + m (GGUF's Q4_0, Q4_1, Q8_0
// and Q4_K map onto this exactly; Q4_0 and Q8_0 have no stored m: m = -zero_point * d).
//
// The activations are quantized per row and block of 32 to int8 (xq, scale xd, block sum xs),
// so each block's product is an exact integer dot product:
//   y[r, n] = sum_g d[n,g] * xd[r,g] * dot(q[n,g,:], xq[r,g,:]) + m[n,g] * (xd[r,g] * xs[r,g])
// Every row is computed by the same sequence of operations whatever the other rows are, so a
// row's result is bit-identical at any M.
#pragma once
#include <cstdint>

namespace verispec {

// The widest K the kernels take (a column's scales live on the stack).
constexpr int64_t kMaxGroups = 4096;

inline int64_t pad8(int64_t groups) { return (groups + 7) / 8 * 8; }

struct QGemmArgs {
  int64_t M, N, K;        // K a multiple of 32, at most 32 * kMaxGroups
  const int8_t* xq;       // [M, K]
  const float* xd;        // [M, K / 32]
  const float* xm;        // [M, pad8(K / 32)] xd * xs, zero past K / 32
  const uint8_t* w;       // bits 4: [N, K / 2], byte j of a block holds q[j] (low nibble) and
                          // q[j + 16] (high nibble), as GGUF does; bits 8: [N, K]
  const void* d;          // [N, K / 32] float16 (uint16_t bits) or float32
  const void* m;          // [N, K / 32] like d, or null: m = -zero_point * d
  int bits;               // 4 or 8
  bool scales_fp32;
  int zero_point;
  float* y;               // [M, ldy], columns [0, N) written
  int64_t ldy;
};

// Columns [n0, n1) of y, one function per instruction set (qgemm_<isa>.cpp).
void qgemm_avx512vnni(const QGemmArgs& a, int64_t n0, int64_t n1);
void qgemm_avxvnni(const QGemmArgs& a, int64_t n0, int64_t n1);
void qgemm_avx2(const QGemmArgs& a, int64_t n0, int64_t n1);
void qgemm_generic(const QGemmArgs& a, int64_t n0, int64_t n1);

}  // namespace verispec
