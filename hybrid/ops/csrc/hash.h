// The integer hashes shared by the id map, the routing of raw ids and the initial rows: fmix64
// (MurmurHash3's 64-bit finalizer) and the lowbias32 finalizer, as hybrid/ops/reference.py
// computes them with torch's integer arithmetic.
#pragma once

#include <cstdint>

namespace hybrid {
namespace hash {

// MurmurHash3's 64-bit finalizer: every input bit moves every output bit.
inline uint64_t fmix64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xFF51AFD7ED558CCDull;
  k ^= k >> 33;
  k *= 0xC4CEB9FE1A85EC53ull;
  k ^= k >> 33;
  return k;
}

// The part of a raw id of a dynamic table: torch.remainder(int64(fmix64(id)), partitions). For a
// power of two that is the hash's low bits (a floor modulo of a two's-complement value), without
// a 64-bit division.
inline int64_t part_of(int64_t id, int64_t partitions) {
  const uint64_t h = fmix64(static_cast<uint64_t>(id));
  if ((partitions & (partitions - 1)) == 0) return static_cast<int64_t>(h & static_cast<uint64_t>(partitions - 1));
  const int64_t r = static_cast<int64_t>(h) % partitions;
  return r < 0 ? r + partitions : r;
}

inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x7FEB352Du;
  h ^= h >> 15;
  h *= 0x846CA68Bu;
  return h ^ (h >> 16);
}

// The hash of global row r of the table keyed `key`, chained over the row's two halves.
inline uint32_t row_hash(uint64_t r, uint32_t key) {
  const uint32_t h = fmix32(static_cast<uint32_t>(r) ^ key);
  return fmix32(h ^ static_cast<uint32_t>(r >> 32));
}

// Element c of the initial row whose row_hash is h: uniform in [-bound, bound).
inline float initial_value(uint32_t h, int64_t c, float bound) {
  const uint32_t e = fmix32(h ^ static_cast<uint32_t>(c));
  // (e >> 8) < 2**24 is exact in float32, and so are the scaling and the shift to [-1, 1).
  const float u = static_cast<float>(e >> 8) * (2.0f / 16777216.0f) - 1.0f;
  return u * bound;
}

}  // namespace hash
}  // namespace hybrid
