// Test helper: rows whose every element is a distinct bit pattern per (rank, row, column), so
// that a test of an exchange can tell where each row came from, in any dtype (the ops move rows
// and never change a bit). No element is all zero bits: zeroed or untouched rows never match.
#pragma once

#include <cstdint>
#include <cstring>

#include "host_tensor.h"

namespace moekit::test {

inline uint32_t pattern(int q, int64_t row, int64_t col) {
  uint32_t h = static_cast<uint32_t>(q + 1) * 0x9E3779B1u ^
               static_cast<uint32_t>(row + 1) * 0x85EBCA77u ^
               static_cast<uint32_t>(col + 1) * 0xC2B2AE3Du;
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  h ^= h >> 12;
  return h | 0x00010001u;
}

// Rank q's rows: [rows, H] of dtype dt, every element its pattern's low bytes.
inline HostTensor rows_of(int q, int64_t rows, int64_t H, DType dt) {
  HostTensor t(dt, {rows, H});
  const size_t s = dtype_size(dt);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < H; ++c) {
      const uint32_t v = pattern(q, r, c);
      std::memcpy(t.bytes.data() + (r * H + c) * s, &v, s);
    }
  }
  return t;
}

// Row ra of a and row rb of b hold the same bytes (both [*, H] of one dtype).
inline bool same_row(const HostTensor& a, int64_t ra, const HostTensor& b, int64_t rb) {
  const size_t n = static_cast<size_t>(a.shape[1]) * dtype_size(a.dtype);
  return std::memcmp(a.bytes.data() + ra * n, b.bytes.data() + rb * n, n) == 0;
}

}  // namespace moekit::test
