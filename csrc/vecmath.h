// exp(x) for float32 as plain arithmetic (no libm call), so that loops over it vectorize: the
// row-by-row attention's softmax weights and the decoder's SiLU take one per value. Each call
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

namespace verispec {

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

}  // namespace verispec
