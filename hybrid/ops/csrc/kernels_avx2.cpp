// The row kernels compiled for AVX2 and FMA (x86-64 only), used where the CPU has both
// (dispatch() in route.cpp); the rest of the extension stays baseline x86-64.
#if defined(__x86_64__)
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "convert.h"
#include "hash.h"
#include "kernels.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

#define HY_ISA avx2
#define HY_ISA_NAME "avx2+fma"
#define HY_KERNELS avx2_kernels
#include "kernels_impl.h"

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif
#endif
