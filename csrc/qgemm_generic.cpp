// qgemm for any CPU (scalar integer dot products); the body is qgemm_kernel.inc.
#include <cstdint>
#include <algorithm>
#define VS_KERNEL qgemm_generic
#define VS_DOT VS_DOT_GENERIC
#include "qgemm_kernel.inc"
