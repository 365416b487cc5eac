// qgemm for CPUs with avx2,fma,f16c,avx512f,avx512bw,avx512vl and no VNNI (Intel Xeon Skylake-SP
// and the like); the body is qgemm_kernel.inc.
#include <cstdint>
#include <algorithm>
#include <immintrin.h>
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")
#define VS_KERNEL qgemm_avx512bw
#define VS_DOT VS_DOT_AVX512BW
#include "qgemm_kernel.inc"
