// qgemm for CPUs with avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni; the body is qgemm_kernel.inc.
#include <cstdint>
#include <algorithm>
#include <immintrin.h>
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#define VS_KERNEL qgemm_avx512vnni
#define VS_DOT VS_DOT_AVX512VNNI
#include "qgemm_kernel.inc"
