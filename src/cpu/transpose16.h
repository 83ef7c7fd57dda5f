// Internal: a 16 x 16 transpose of 32-bit elements in AVX-512 registers, for the kernels that
// repack pairs of bf16 (one 32-bit element each) across rows: the pair kernels' transposed panels
// (ragged_dot_stream.cpp) and the AMX input gradient's rows and sum tiles (ragged_dot_amx.cpp).
// Compiled for AVX-512F and inlined into callers built for a superset of it; its loops unrolled
// (GCC 12 otherwise keeps such register arrays on the stack).
#pragma once

#include <immintrin.h>

namespace moekit::detail {

// r[j] := (r[0][j], r[1][j], ..., r[15][j]) for j < 16: rows in, columns out, 32-bit lanes; four
// rounds of 16 shuffles (within 128-bit lanes twice, then across them twice).
__attribute__((target("avx512f"), always_inline)) inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

}  // namespace moekit::detail
