#include "f32linear.h"
#include "qlinear.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <utility>

namespace verispec {
namespace {

constexpr int kLanes = 16;  // running sums per output element (f32linear.h)

// MR activation rows times one weight row: y[r * ldy] for r < MR.
using BlockFn = void (*)(const float* x, int64_t k, const float* w, float* y, int64_t ldy);

// Block<MR>::run for MR = 1, 2, ..., at index MR - 1.
template <template <int> class Block, int... I>
constexpr std::array<BlockFn, sizeof...(I)> block_table(std::integer_sequence<int, I...>) {
  return {&Block<I + 1>::run...};
}

// The fixed tree over eight sums: [l] + [l+4], then [l] + [l+2], then [0] + [1].
__attribute__((target("avx2"))) inline float reduce8(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

__attribute__((target("avx512f"))) inline float reduce16(__m512 v) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return reduce8(_mm256_add_ps(_mm512_castps512_ps256(v), hi));
}

// One weight row at a time: two or three side by side (fewer activation loads) ran 20-50%
// slower on the AMD EPYC of the development machine, where the product is bound by memory.
template <int MR>
struct Avx512Block {
  __attribute__((target("avx512f"))) static void run(const float* x, int64_t k, const float* w,
                                                     float* y, int64_t ldy) {
    __m512 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + kLanes <= k; i += kLanes) {
      const __m512 wv = _mm512_loadu_ps(w + i);
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * k + i), wv, acc[r]);
    }
    if (i < k) {  // lanes past k add 0 * 0, as the portable path does
      const __mmask16 mask = static_cast<__mmask16>((1u << (k - i)) - 1);
      const __m512 wv = _mm512_maskz_loadu_ps(mask, w + i);
      for (int r = 0; r < MR; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + r * k + i), wv, acc[r]);
      }
    }
    for (int r = 0; r < MR; ++r) y[r * ldy] = reduce16(acc[r]);
  }
};

// The same with each 16-lane sum in two 8-lane registers (lanes 0-7, 8-15).
template <int MR>
struct Avx2Block {
  template <bool kMasked>
  __attribute__((target("avx2,fma"))) static __m256 load(const float* p, __m256i mask) {
    if constexpr (kMasked) return _mm256_maskload_ps(p, mask);
    return _mm256_loadu_ps(p);
  }

  // Elements i .. i+15 into the sums (past k: 0 * 0 where kMasked).
  template <bool kMasked>
  __attribute__((target("avx2,fma"))) static void step(const float* x, int64_t k, const float* w,
                                                       int64_t i, __m256i mask_lo,
                                                       __m256i mask_hi, __m256 (&lo)[MR],
                                                       __m256 (&hi)[MR]) {
    const __m256 wl = load<kMasked>(w + i, mask_lo), wh = load<kMasked>(w + i + 8, mask_hi);
    for (int r = 0; r < MR; ++r) {
      lo[r] = _mm256_fmadd_ps(load<kMasked>(x + r * k + i, mask_lo), wl, lo[r]);
      hi[r] = _mm256_fmadd_ps(load<kMasked>(x + r * k + i + 8, mask_hi), wh, hi[r]);
    }
  }

  __attribute__((target("avx2,fma"))) static void run(const float* x, int64_t k, const float* w,
                                                      float* y, int64_t ldy) {
    __m256 lo[MR], hi[MR];
    for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    const __m256i all = _mm256_set1_epi32(-1);
    int64_t i = 0;
    for (; i + kLanes <= k; i += kLanes) step<false>(x, k, w, i, all, all, lo, hi);
    if (i < k) {
      alignas(32) int32_t bits[kLanes];
      for (int l = 0; l < kLanes; ++l) bits[l] = i + l < k ? -1 : 0;
      step<true>(x, k, w, i, _mm256_load_si256(reinterpret_cast<const __m256i*>(bits)),
                 _mm256_load_si256(reinterpret_cast<const __m256i*>(bits + 8)), lo, hi);
    }
    for (int r = 0; r < MR; ++r) y[r * ldy] = reduce8(_mm256_add_ps(lo[r], hi[r]));
  }
};

// Any CPU: the same sums and tree in scalar code (std::fma rounds once, as the instructions do).
template <int MR>
struct PortableBlock {
  static void run(const float* x, int64_t k, const float* w, float* y, int64_t ldy) {
    for (int r = 0; r < MR; ++r) {
      float s[kLanes] = {};
      for (int64_t i = 0; i < k; i += kLanes) {
        for (int l = 0; l < kLanes; ++l) {
          const bool in = i + l < k;
          s[l] = std::fma(in ? x[r * k + i + l] : 0.0f, in ? w[i + l] : 0.0f, s[l]);
        }
      }
      for (int width = kLanes / 2; width >= 1; width /= 2)
        for (int l = 0; l < width; ++l) s[l] = s[l] + s[l + width];
      y[r * ldy] = s[0];
    }
  }
};

struct Isa {
  const char* name;
  int64_t rows;  // activation rows per block: their sums fit the registers
  const BlockFn* table;
  bool (*supported)();
};

constexpr auto kAvx512 = block_table<Avx512Block>(std::make_integer_sequence<int, 8>{});
constexpr auto kAvx2 = block_table<Avx2Block>(std::make_integer_sequence<int, 4>{});
constexpr auto kPortable = block_table<PortableBlock>(std::make_integer_sequence<int, 1>{});

bool has_avx512() { return !portable_forced() && __builtin_cpu_supports("avx512f"); }
bool has_avx2() {
  return !portable_forced() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
bool always() { return true; }

const Isa kIsas[] = {
    {"avx512", 8, kAvx512.data(), has_avx512},
    {"avx2", 4, kAvx2.data(), has_avx2},
    {"generic", 1, kPortable.data(), always},
};

}  // namespace

std::vector<std::string> f32_isas() {
  std::vector<std::string> names;
  for (const Isa& isa : kIsas) {
    if (isa.supported()) names.emplace_back(isa.name);
  }
  return names;
}

void f32_linear(const float* x, int64_t m, int64_t k, const float* w, int64_t n, float* y,
                const std::string& name) {
  RECORD_USER_SCOPE("verispec::product");
  const Isa* isa = nullptr;
  for (const Isa& candidate : kIsas) {
    if (name == candidate.name) isa = &candidate;
  }
  TORCH_CHECK(isa != nullptr, "isa='", name, "' is unknown: expected avx512, avx2 or generic");
  TORCH_CHECK(isa->supported(), "isa='", name, "' is not supported by this CPU");
  if (m == 0 || n == 0) return;
  // Enough columns per task that its weights (>= 32 KB) outweigh its start-up.
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / (std::max<int64_t>(k, 1) * 4));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      // The weight row stays in cache while every block of activation rows passes it.
      for (int64_t r = 0; r < m; r += isa->rows) {
        const int64_t rows = std::min<int64_t>(isa->rows, m - r);
        isa->table[rows - 1](x + r * k, k, w + c * k, y + r * n + c, n);
      }
    }
  });
}

}  // namespace verispec
