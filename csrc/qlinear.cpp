#include "qlinear.h"
#include "vecmath.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

namespace verispec {
namespace {

struct Isa {
  const char* name;
  Kernel kernel;
  bool (*supported)();
};

bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
bool has_avxvnni() { return has_avx2() && __builtin_cpu_supports("avxvnni"); }
bool has_avx512bw() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}
bool has_avx512vnni() { return has_avx512bw() && __builtin_cpu_supports("avx512vnni"); }
// AMX's tile data is off for a process until it asks the kernel for it (Linux 5.16 and later);
// where that is refused (an older kernel, a hypervisor hiding it), the CPU's flags alone would
// make the first tile instruction fault.
bool has_amx() {
  static const bool yes = [] {
    unsigned eax, ebx, ecx, edx;
    if (!has_avx512vnni() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool tile = edx & (1u << 24), int8 = edx & (1u << 25);
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return tile && int8 && syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return yes;
}
bool always() { return true; }

// Best first.
const Isa kIsas[] = {
    {"amx", qgemm_amx, has_amx},
    {"avx512vnni", qgemm_avx512vnni, has_avx512vnni},
    {"avxvnni", qgemm_avxvnni, has_avxvnni},
    {"avx512bw", qgemm_avx512bw, has_avx512bw},
    {"avx2", qgemm_avx2, has_avx2},
    {"generic", qgemm_generic, always},
};

}  // namespace

bool portable_forced() {
  static const bool forced = std::getenv("VERISPEC_CPU_KERNEL") != nullptr &&
                             std::string(std::getenv("VERISPEC_CPU_KERNEL")) == "generic";
  return forced;
}

bool use_avx2_f16c() {
  static const bool yes = has_avx2() && !portable_forced();
  return yes;
}

Kernel kernel_for(const std::string& name) {
  for (const Isa& isa : kIsas) {
    if (name == isa.name) {
      TORCH_CHECK(isa.supported(), "isa='", name, "' is not supported by this CPU");
      return isa.kernel;
    }
  }
  TORCH_CHECK(false, "isa='", name, "' is unknown: expected amx, avx512vnni, avxvnni, avx512bw, avx2 or generic");
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (const Isa& isa : kIsas) {
    if (isa.supported()) names.emplace_back(isa.name);
  }
  return names;
}

void Panels::check(int64_t k) const {
  TORCH_CHECK(bits == 4 || bits == 8, "bits=", bits, " is invalid: expected 4 or 8");
  TORCH_CHECK(k % kBlock == 0, "x has ", k, " columns: expected a multiple of 32");
  const int64_t panels = (n + kPanel - 1) / kPanel, groups = k / kBlock;
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                  packed.numel() == panels * groups * kPanel * kBlock * bits / 8,
              "w must be contiguous uint8 [ceil(N / 16), K / 32, 64 * bits]");
  TORCH_CHECK((d.scalar_type() == torch::kFloat32 || d.scalar_type() == torch::kFloat16) &&
                  d.is_contiguous() && d.numel() == panels * groups * kPanel,
              "d must be contiguous float16 or float32 [ceil(N / 16), K / 32, 16]");
  if (m.defined()) {
    TORCH_CHECK(m.scalar_type() == d.scalar_type() && m.is_contiguous() && m.numel() == d.numel(),
                "m must be like d");
  }
}

// Blocks [begin, end) of 32 (quantize_into). Written without branches or library calls, so
// the compiler vectorizes them: the maximum is taken in sixteen lanes (exact in any order; NaN
// is ignored, as fmax does), and adding and subtracting 1.5 * 2^23 rounds a value of magnitude
// <= 127 to an integer, ties to even, as nearbyint (and torch.round) do. Blocks go in groups of
// sixteen, the group's scales in one vector of divisions: a scalar division per block cost as
// much as quantizing its 32 values (0.93 -> 0.32 ns a value on the Xeon of 2026-11-27).
VS_CLONES void quantize_blocks(const float* __restrict x, int64_t begin, int64_t end,
                               int8_t* __restrict xq, float* __restrict xd, int32_t* xs,
                               float* xm) {
  constexpr int64_t kGroup = 16;
  for (int64_t first = begin; first < end; first += kGroup) {
    const int64_t count = std::min(kGroup, end - first);
    float amax[kGroup], inv[kGroup];
    for (int64_t b = 0; b < count; ++b) {
      const float* src = x + (first + b) * kBlock;
      float lanes[16];
      for (int l = 0; l < 16; ++l) {
        const float low = std::fabs(src[l]), high = std::fabs(src[l + 16]);
        lanes[l] = 0.0f < low ? low : 0.0f;
        lanes[l] = lanes[l] < high ? high : lanes[l];
      }
      float most = 0.0f;
      for (int l = 0; l < 16; ++l) most = most < lanes[l] ? lanes[l] : most;
      amax[b] = most;
    }
    for (int64_t b = 0; b < count; ++b) {
      inv[b] = amax[b] > 0.0f ? 127.0f / amax[b] : 0.0f;
      xd[first + b] = amax[b] / 127.0f;
    }
    for (int64_t b = 0; b < count; ++b) {
      const int64_t i = first + b;
      const float* src = x + i * kBlock;
      int32_t sum = 0;
      for (int64_t j = 0; j < kBlock; ++j) {
        const int32_t q = static_cast<int32_t>((src[j] * inv[b] + 12582912.0f) - 12582912.0f);
        xq[i * kBlock + j] = static_cast<int8_t>(q);
        sum += q;
      }
      if (xs != nullptr) xs[i] = sum;
      if (xm != nullptr) xm[i] = xd[i] * static_cast<float>(sum);
    }
  }
}

void quantize_into(const float* x, int64_t rows, int64_t k, int8_t* xq, float* xd, int32_t* xs,
                   float* xm) {
  at::parallel_for(0, rows * (k / kBlock), 256, [&](int64_t begin, int64_t end) {
    quantize_blocks(x, begin, end, xq, xd, xs, xm);
  });
}

void QuantizedRows::quantize(const float* x, int64_t m, int64_t width) {
  RECORD_USER_SCOPE("verispec::quantize");  // ranges torch.profiler reads (bench/step_profile.py)
  rows = m;
  k = width;
  xq.resize(m * width);
  xd.resize(m * width / kBlock);
  xm.resize(xd.size());
  xs.resize(xd.size());
  quantize_into(x, m, width, xq.data(), xd.data(), xs.data(), xm.data());
}

void qlinear_into(const QuantizedRows& x, const Panels& w, Kernel kernel, float* y, int64_t ldy) {
  RECORD_USER_SCOPE("verispec::product");
  if (x.rows == 0 || w.n == 0) return;
  const int64_t panels = (w.n + kPanel - 1) / kPanel;
  QGemmArgs args{x.rows, w.n, x.k, x.xq.data(), x.xd.data(), x.xm.data(), x.xs.data(),
                 w.packed.data_ptr<uint8_t>(), w.d.data_ptr(),
                 w.m.defined() ? w.m.data_ptr() : nullptr, static_cast<int>(w.bits),
                 w.d.scalar_type() == torch::kFloat32, static_cast<int>(w.zero_point), y, ldy};
  // Enough panels per task that a task's weights (>= 16 KB) outweigh its start-up. One row too:
  // with a model's layers in one compiled call (decoder.h) the threads stay awake between
  // products, and two cores read the weights faster than one (greedy batch 1 on the embedded
  // model: 202 against 150 tokens/s with one-row products kept on one thread, as they were
  // while torch operations ran between the products and a second thread only added its
  // start-up).
  const int64_t grain = std::max<int64_t>(1, (16 << 10) / (kPanel * x.k * w.bits / 8));
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) { kernel(args, begin, end); });
}

namespace {

template <typename Scale>
void dequantize_rows_as(const Panels& w, int64_t k, const int64_t* ids, int64_t count,
                        float* out) {
  const int64_t groups = k / kBlock, chunk = kPanel * kBlock * w.bits / 8;
  const uint8_t* packed = w.packed.data_ptr<uint8_t>();
  const Scale* d = static_cast<const Scale*>(w.d.data_ptr());
  const Scale* m = w.m.defined() ? static_cast<const Scale*>(w.m.data_ptr()) : nullptr;
  for (int64_t r = 0; r < count; ++r) {
    const int64_t id = ids[r], panel = id / kPanel, lane = id % kPanel;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = (panel * groups + g) * kPanel + lane;
      const float scale = static_cast<float>(d[at]);
      const float minimum = m != nullptr ? static_cast<float>(m[at])
                                         : -static_cast<float>(w.zero_point) * scale;
      // Word c of a block (bytes 4c .. 4c+3 of the row's block) sits at lane `lane` of the
      // panel chunk's c-th group of 16 words (formats.py, PanelWeight.from_rows).
      const uint8_t* words = packed + (panel * groups + g) * chunk;
      float* y = out + r * k + g * kBlock;
      for (int64_t j = 0; j < kBlock * w.bits / 8; ++j) {
        const uint8_t byte = words[((j / 4) * kPanel + lane) * 4 + j % 4];
        if (w.bits == 8) {
          y[j] = static_cast<float>(byte) * scale + minimum;
        } else {  // low nibble: element j, high nibble: element j + 16
          y[j] = static_cast<float>(byte & 0x0F) * scale + minimum;
          y[j + kBlock / 2] = static_cast<float>(byte >> 4) * scale + minimum;
        }
      }
    }
  }
}

}  // namespace

void dequantize_rows(const Panels& w, int64_t k, const int64_t* ids, int64_t count, float* out) {
  for (int64_t r = 0; r < count; ++r) {
    TORCH_CHECK(0 <= ids[r] && ids[r] < w.n, "row ", ids[r], " is not within [0, ", w.n, ")");
  }
  if (w.d.scalar_type() == torch::kFloat32) {
    dequantize_rows_as<float>(w, k, ids, count, out);
  } else {
    dequantize_rows_as<c10::Half>(w, k, ids, count, out);
  }
}

}  // namespace verispec
