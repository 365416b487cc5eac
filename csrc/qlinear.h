// The quantized product as a C++ call: the instruction set's kernel chosen by name, the
// activations' quantization, and y = x W^T over the panels (qgemm.h) on torch's threads.
// binding.cpp exposes it to Python; decoder.cpp calls it for every linear layer of a step.
#pragma once
#include <torch/extension.h>

#include <string>
#include <vector>

#include "qgemm.h"

namespace verispec {

using Kernel = void (*)(const QGemmArgs&, int64_t, int64_t);

constexpr int64_t kBlock = 32;

// The kernel of instruction set `isa` (amx, avx512vnni, avxvnni, avx2, generic); an error naming it
// when it is unknown or this CPU lacks it.
Kernel kernel_for(const std::string& isa);

// The instruction sets this CPU runs, best first.
std::vector<std::string> supported_isas();

// Whether VERISPEC_CPU_KERNEL forces "generic" (read once): every compiled loop then takes its
// portable path.
bool portable_forced();

// Whether the other compiled loops (attention, float16 conversions) take their AVX2 + F16C
// paths: the CPU has them and the portable paths are not forced.
bool use_avx2_f16c();

// One weight in panels (verispec/model/quant/formats.py, PanelWeight).
struct Panels {
  torch::Tensor packed;  // [ceil(N / 16), K / 32, 64 * bits] uint8
  torch::Tensor d;       // [ceil(N / 16), K / 32, 16] float16 or float32
  torch::Tensor m;       // like d, or undefined: m = -zero_point * d
  int64_t bits, zero_point, n;

  // Checks the tensors against n and k, naming what is wrong.
  void check(int64_t k) const;
};

// x [M, K] quantized per row and block of 32: xq [M, K], xd [M, K/32] = amax / 127,
// xq = round-half-even(x * (127 / amax)), xs [M, K/32] = sum(xq) (where not null) and
// xm [M, K/32] = xd * xs (where not null).
void quantize_into(const float* x, int64_t rows, int64_t k, int8_t* xq, float* xd, int32_t* xs,
                   float* xm);

// Activations quantized once and multiplied with several weights of the same width.
struct QuantizedRows {
  int64_t rows = 0, k = 0;
  std::vector<int8_t> xq;
  std::vector<float> xd, xm;
  std::vector<int32_t> xs;

  void quantize(const float* x, int64_t rows, int64_t k);
};

// y[r, 0 .. n) for every row r (row stride ldy) = x times w transposed.
void qlinear_into(const QuantizedRows& x, const Panels& w, Kernel kernel, float* y, int64_t ldy);

// out [count, k] = rows ids[0 .. count) of w as float32, d * q + m as QuantizedWeight.dequantize
// computes it (a tied LM head serves the embedding lookups).
void dequantize_rows(const Panels& w, int64_t k, const int64_t* ids, int64_t count, float* out);

}  // namespace verispec
