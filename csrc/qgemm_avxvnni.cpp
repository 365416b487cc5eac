// qgemm for CPUs with avx2,fma,f16c,avxvnni; the body is qgemm_kernel.inc.
#include <cstdint>
#include <algorithm>
#include <immintrin.h>
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define VS_KERNEL qgemm_avxvnni
#define VS_DOT VS_DOT_AVXVNNI
#include "qgemm_kernel.inc"
