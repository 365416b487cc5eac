// qgemm for CPUs with avx2,fma,f16c; the body is qgemm_kernel.inc.
#include <cstdint>
#include <algorithm>
#include <immintrin.h>
#pragma GCC target("avx2,fma,f16c")
#define VS_KERNEL qgemm_avx2
#define VS_DOT VS_DOT_AVX2
#include "qgemm_kernel.inc"
