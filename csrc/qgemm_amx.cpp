// qgemm for CPUs with AMX-INT8 beside AVX-512 VNNI (Intel Xeon since Sapphire Rapids): a panel
// block's integer dot products for up to 16 rows in one tile instruction, TDPBSUD (signed
// activations times unsigned weights, exact int32 sums), instead of 8 VNNI instructions per row.
// The float part per row and block is the avx512vnni variant's, operation for operation
// (qgemm_kernel.inc), so the two agree bit for bit and a row's result does not depend on the
// other rows. Fewer than kMinRows rows run the avx512vnni kernel: a tile's fixed cost per block
// (the tile loads, the sums' round trip through memory) outweighs what it saves on a few rows.
//
// Tiles: C (rows x 16 int32, one per row tile and panel in flight), A (rows x 32 activation
// bytes of a block, one per row tile, shared by the panels in flight), B (8 x 64 bytes: a panel
// block's chunks, each row the four bytes of its 16 columns that the A row's four bytes meet; the
// 8-bit panels' layout as stored, the 4-bit panels' nibbles unpacked into that layout first).
// Two row tiles (up to 32 rows) share each B, so 17 rows read and unpack the weights once, not
// twice: one tile after the other, the embedded model's products for a step cost 2.5-3.4 ms more
// at 17 rows than at 16 (a batch of 16's first draft row: +27-44 %); sharing B, 0.2-1.4 ms.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "qgemm.h"

#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")

namespace verispec {
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTileRows = 16;
// Panels whose tiles are in flight together: tiles are not renamed, so one panel's block
// waits on the last one's store; two overlap their tile instructions and float work.
constexpr int kInFlight = 2;
// Measured on the embedded model's products (2 threads, Intel Xeon with AMX): the tiles take
// 0.93x the avx512vnni kernel's time at 8 rows, 0.87x at 12, 0.72x at 16, 0.71x at 32, and
// 1.1-1.6x at 2-6 rows.
constexpr int64_t kMinRows = 8;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Row tiles in flight together: the 8 tile registers hold C of 2 row tiles x 2 panels, A of
// each row tile and B of each panel.
constexpr int kRowTiles = 2;

// Tile numbers, literal: the intrinsics paste them into the instruction's text. Row tile 0's
// C of panel i is i, its A 2; B of panel i is 3 + i; row tile 1's C of panel i is 5 + i, its A 7.
#define VS_TILE_C00 0
#define VS_TILE_C01 1
#define VS_TILE_A0 2
#define VS_TILE_B0 3
#define VS_TILE_B1 4
#define VS_TILE_C10 5
#define VS_TILE_C11 6
#define VS_TILE_A1 7
static_assert(kInFlight == 2 && kRowTiles == 2, "the tile numbers above are those of 2 x 2 tiles");
constexpr int kTileC[kRowTiles][kInFlight] = {{VS_TILE_C00, VS_TILE_C01}, {VS_TILE_C10, VS_TILE_C11}};
constexpr int kTileA[kRowTiles] = {VS_TILE_A0, VS_TILE_A1};
constexpr int kTileB[kInFlight] = {VS_TILE_B0, VS_TILE_B1};

// rows[t]: the rows of row tile t (0: unused).
void configure(const int (&rows)[kRowTiles]) {
  TileConfig config;
  for (int t = 0; t < kRowTiles; ++t) {
    if (rows[t] == 0) continue;
    for (int i = 0; i < kInFlight; ++i) {
      config.rows[kTileC[t][i]] = static_cast<uint8_t>(rows[t]);
      config.colsb[kTileC[t][i]] = 4 * kPanel;
    }
    config.rows[kTileA[t]] = static_cast<uint8_t>(rows[t]);
    config.colsb[kTileA[t]] = kBlock;
  }
  for (int i = 0; i < kInFlight; ++i) {
    config.rows[kTileB[i]] = kBlock / 4;
    config.colsb[kTileB[i]] = kChunk;
  }
  // GCC 12 does not count the builtin as reading `config` and drops the stores above without
  // this (the tiles then run unconfigured: SIGILL).
  asm volatile("" : : "m"(config));
  _tile_loadconfig(&config);
}

inline __m512 scales(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 scales(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// B of a 4-bit panel block: chunk j's low nibbles are elements 4j .. 4j+3 (B row j), its high
// nibbles elements 16+4j .. 16+4j+3 (B row 4 + j).
inline void unpack4(const uint8_t* w, uint8_t* b) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m512i packed = _mm512_loadu_si512(w + kChunk * j);
    _mm512_store_si512(b + kChunk * j, _mm512_and_si512(packed, low));
    _mm512_store_si512(b + kChunk * (j + 4), _mm512_and_si512(_mm512_srli_epi16(packed, 4), low));
  }
}

// Panels [p, p + NP) (NP <= kInFlight) for rows r0 .. r0 + tile_rows[0] + tile_rows[1] - 1
// in NT row tiles (tile_rows[1] is 0 when NT is 1), as a pipeline over the blocks: block g + 1's
// 4-bit weights are unpacked while block g's tiles multiply, and block g's sums are scaled one
// block later, so no tile instruction waits on stores just issued (a tile load does not take
// data from the store buffer) and no vector load on a tile store.
template <int BITS, typename S, bool MIN, int NP, int NT>
void panel_rows(const QGemmArgs& a, int64_t p, int64_t r0, const int (&tile_rows)[kRowTiles]) {
  const int64_t groups = a.K / kBlock;
  const int64_t block_bytes = kPanel * kBlock * BITS / 8;
  const int32_t offset = MIN ? 0 : -a.zero_point;
  const int rows = tile_rows[0] + (NT > 1 ? tile_rows[1] : 0);
  alignas(64) uint8_t unpacked[2][kInFlight][8 * kChunk];  // [block parity][panel]
  alignas(64) int32_t dots[2][kInFlight][kRowTiles * kTileRows][kPanel];  // [block parity][panel][row]
  __m512 acc[kInFlight][kRowTiles * kTileRows];
  for (int i = 0; i < NP; ++i) {
    for (int r = 0; r < rows; ++r) acc[i][r] = _mm512_setzero_ps();
  }
  const int8_t* xq = a.xq + r0 * a.K;
  const float* xd = a.xd + r0 * groups;
  const float* xm = a.xm + r0 * groups;
  const int32_t* xs = a.xs + r0 * groups;
  auto weights = [&](int i, int64_t g) { return a.w + ((p + i) * groups + g) * block_bytes; };
  auto unpack = [&](int64_t g) {
    if constexpr (BITS == 4) {
      for (int i = 0; i < NP; ++i) unpack4(weights(i, g), unpacked[g % 2][i]);
    }
  };
  auto b_of = [&](int i, int64_t g) -> const uint8_t* {
    return BITS == 4 ? unpacked[g % 2][i] : weights(i, g);
  };
  auto scale = [&](int64_t g) {  // block g's sums into the accumulators
    for (int i = 0; i < NP; ++i) {
      const int64_t index = (p + i) * groups + g;
      const __m512 d = scales(static_cast<const S*>(a.d) + index * kPanel);
      __m512 m;
      if (MIN) m = scales(static_cast<const S*>(a.m) + index * kPanel);
      for (int r = 0; r < rows; ++r) {
        const int64_t rg = r * groups + g;
        __m512i dot = _mm512_load_si512(dots[g % 2][i][r]);
        if (!MIN) dot = _mm512_add_epi32(_mm512_set1_epi32(offset * xs[rg]), dot);
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(xd[rg])),
                                    acc[i][r]);
        if (MIN) acc[i][r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xm[rg]), acc[i][r]);
      }
    }
  };
  const int8_t* xq1 = xq + tile_rows[0] * a.K;  // row tile 1's activations
  unpack(0);
  for (int64_t g = 0; g < groups; ++g) {
    for (int i = 0; i < NP; ++i) {
      const uintptr_t w = reinterpret_cast<uintptr_t>(weights(i, g));
      for (int64_t line = 0; line < block_bytes; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch + line), _MM_HINT_T0);
      }
    }
    _tile_loadd(VS_TILE_A0, xq + g * kBlock, a.K);
    if constexpr (NT > 1) _tile_loadd(VS_TILE_A1, xq1 + g * kBlock, a.K);
    _tile_zero(VS_TILE_C00);
    _tile_loadd(VS_TILE_B0, b_of(0, g), kChunk);
    _tile_dpbsud(VS_TILE_C00, VS_TILE_A0, VS_TILE_B0);
    if constexpr (NT > 1) {
      _tile_zero(VS_TILE_C10);
      _tile_dpbsud(VS_TILE_C10, VS_TILE_A1, VS_TILE_B0);
    }
    if constexpr (NP > 1) {
      _tile_zero(VS_TILE_C01);
      _tile_loadd(VS_TILE_B1, b_of(1, g), kChunk);
      _tile_dpbsud(VS_TILE_C01, VS_TILE_A0, VS_TILE_B1);
      if constexpr (NT > 1) {
        _tile_zero(VS_TILE_C11);
        _tile_dpbsud(VS_TILE_C11, VS_TILE_A1, VS_TILE_B1);
      }
    }
    if (g + 1 < groups) unpack(g + 1);
    if (g > 0) scale(g - 1);
    _tile_stored(VS_TILE_C00, dots[g % 2][0], 4 * kPanel);
    if constexpr (NT > 1) _tile_stored(VS_TILE_C10, dots[g % 2][0][tile_rows[0]], 4 * kPanel);
    if constexpr (NP > 1) {
      _tile_stored(VS_TILE_C01, dots[g % 2][1], 4 * kPanel);
      if constexpr (NT > 1) _tile_stored(VS_TILE_C11, dots[g % 2][1][tile_rows[0]], 4 * kPanel);
    }
  }
  scale(groups - 1);
  for (int i = 0; i < NP; ++i) {
    const int64_t first = (p + i) * kPanel;
    const int64_t columns = std::min<int64_t>(kPanel, a.N - first);
    if (columns <= 0) continue;
    const __mmask16 mask = static_cast<__mmask16>((1u << columns) - 1);
    for (int r = 0; r < rows; ++r) _mm512_mask_storeu_ps(a.y + (r0 + r) * a.ldy + first, mask, acc[i][r]);
  }
}

template <int BITS, typename S, bool MIN, int NT>
void panels_in_flight(const QGemmArgs& a, int64_t p0, int64_t p1, int64_t r0,
                      const int (&tile_rows)[kRowTiles]) {
  int64_t p = p0;
  for (; p + kInFlight <= p1; p += kInFlight) panel_rows<BITS, S, MIN, kInFlight, NT>(a, p, r0, tile_rows);
  if (p < p1) panel_rows<BITS, S, MIN, 1, NT>(a, p, r0, tile_rows);
}

template <int BITS, typename S, bool MIN>
void panels(const QGemmArgs& a, int64_t p0, int64_t p1) {
  // Row tiles of equal sizes, as few as fit the rows, two at a time over the same weights.
  const int64_t tiles = (a.M + kTileRows - 1) / kTileRows;
  auto begin = [&](int64_t t) { return t * a.M / tiles; };
  for (int64_t t = 0; t < tiles; t += kRowTiles) {
    const bool pair = t + 1 < tiles;
    const int tile_rows[kRowTiles] = {static_cast<int>(begin(t + 1) - begin(t)),
                                      pair ? static_cast<int>(begin(t + 2) - begin(t + 1)) : 0};
    configure(tile_rows);
    if (pair) panels_in_flight<BITS, S, MIN, 2>(a, p0, p1, begin(t), tile_rows);
    else panels_in_flight<BITS, S, MIN, 1>(a, p0, p1, begin(t), tile_rows);
  }
  _tile_release();
}

template <int BITS, typename S>
void panels_of(const QGemmArgs& a, int64_t p0, int64_t p1) {
  if (a.m != nullptr) panels<BITS, S, true>(a, p0, p1);
  else panels<BITS, S, false>(a, p0, p1);
}

}  // namespace

void qgemm_amx(const QGemmArgs& a, int64_t p0, int64_t p1) {
  if (a.M < kMinRows) return qgemm_avx512vnni(a, p0, p1);
  if (a.bits == 4) {
    if (a.scales_fp32) panels_of<4, float>(a, p0, p1);
    else panels_of<4, uint16_t>(a, p0, p1);
  } else {
    if (a.scales_fp32) panels_of<8, float>(a, p0, p1);
    else panels_of<8, uint16_t>(a, p0, p1);
  }
}

}  // namespace verispec
