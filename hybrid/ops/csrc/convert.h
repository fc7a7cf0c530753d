// Element conversions between float32 and the 16-bit storage types, rounding as torch's
// .to() does (round to nearest, ties to even; bfloat16 NaN -> 0x7FC0), and finiteness tests.
// Included before any instruction-set pragma, so these compile for the baseline ISA wherever
// they are emitted out of line.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace hybrid {
namespace kernels {

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// x - x is 0 for every finite x and NaN for an infinity or a NaN (a test the compiler vectorizes).
inline bool f32_finite(float f) { return f - f == 0.0f; }

inline float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7FC0;  // NaN
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// IEEE half <-> float (the FP16 library's branch-free conversions, as c10::Half uses).
inline float f16_to_f32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xE0u << 23;
  const float exp_scale = 0x1.0p-112f;
  const float normalized = f32_from_bits((two_w >> 4) + exp_offset) * exp_scale;
  const uint32_t magic_mask = 126u << 23;
  const float magic_bias = 0.5f;
  const float denormalized = f32_from_bits((two_w >> 17) | magic_mask) - magic_bias;
  const uint32_t denormalized_cutoff = 1u << 27;
  const uint32_t result =
      sign | (two_w < denormalized_cutoff ? f32_bits(denormalized) : f32_bits(normalized));
  return f32_from_bits(result);
}

inline uint16_t f32_to_f16(float f) {
  const float scale_to_inf = 0x1.0p+112f;
  const float scale_to_zero = 0x1.0p-110f;
  float base = ((f < 0 ? -f : f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// Storage types as tags: element type, load to float32, store from float32.
struct F32 {
  using T = float;
  static constexpr DType dtype = DType::f32;
  static float load(T x) { return x; }
  static T store(float x) { return x; }
  static bool finite(T x) { return f32_finite(x); }
};

struct BF16 {
  using T = uint16_t;
  static constexpr DType dtype = DType::bf16;
  static float load(T x) { return bf16_to_f32(x); }
  static T store(float x) { return f32_to_bf16(x); }
  static bool finite(T x) { return (x & 0x7f80u) != 0x7f80u; }
};

struct F16 {
  using T = uint16_t;
  static constexpr DType dtype = DType::f16;
  static float load(T x) { return f16_to_f32(x); }
  static T store(float x) { return f32_to_f16(x); }
  static bool finite(T x) { return (x & 0x7c00u) != 0x7c00u; }
};

// Calls f(Tag{}) for the storage tag of dtype.
template <typename F>
inline auto with_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::bf16:
      return f(BF16{});
    case DType::f16:
      return f(F16{});
    default:
      return f(F32{});
  }
}

inline int64_t dtype_size(DType dtype) { return dtype == DType::f32 ? 4 : 2; }

}  // namespace kernels
}  // namespace hybrid
