// The row kernels for any CPU this compiler targets by default (x86-64 baseline, aarch64).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "convert.h"
#include "hash.h"
#include "kernels.h"

#define HY_ISA base
#define HY_ISA_NAME "baseline"
#define HY_KERNELS base_kernels
#include "kernels_impl.h"
