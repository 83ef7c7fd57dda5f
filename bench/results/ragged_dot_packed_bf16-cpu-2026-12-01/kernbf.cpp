// bf16 packed-panel kernels on AVX2, alone: ns per (row, contraction step, panel of 32 columns).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
constexpr int P = 32;
// Today's widened kernel: V vectors of pairs widened once a step, R rows.
template <int R, int V>
__attribute__((noinline)) void wide(const uint16_t* a, long lda, long kc, const uint32_t* panel,
                                    float* sums) {
  __m256 s[R][V];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) s[r][v] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(0xffff0000u);
  for (long kp = 0; kp < kc / 2; ++kp) {
    const uint32_t* row = panel + kp * P;
    __m256 e[V], o[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      __m256i x = _mm256_loadu_si256((const __m256i*)(row + 8 * v));
      e[v] = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
      o[v] = _mm256_castsi256_ps(_mm256_and_si256(x, high));
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t w;
      std::memcpy(&w, a + r * lda + 2 * kp, 4);
      __m256i x = _mm256_set1_epi32(w);
      __m256 a0 = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
      __m256 a1 = _mm256_castsi256_ps(_mm256_and_si256(x, high));
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        s[r][v] = _mm256_fmadd_ps(a0, e[v], s[r][v]);
        s[r][v] = _mm256_fmadd_ps(a1, o[v], s[r][v]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(sums + r * P + 8 * v, s[r][v]);
}
// The widened kernel with A's pairs widened first for every row (2R registers) and the loop over
// the panel's vectors outside the rows: 2 widened vectors live at a time.
template <int R, int V>
__attribute__((noinline)) void widev(const uint16_t* a, long lda, long kc, const uint32_t* panel,
                                     float* sums) {
  __m256 s[R][V];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) s[r][v] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(0xffff0000u);
  for (long kp = 0; kp < kc / 2; ++kp) {
    const uint32_t* row = panel + kp * P;
    __m256 a0[R], a1[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t w;
      std::memcpy(&w, a + r * lda + 2 * kp, 4);
      __m256i x = _mm256_set1_epi32(w);
      a0[r] = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
      a1[r] = _mm256_castsi256_ps(_mm256_and_si256(x, high));
    }
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      __m256i x = _mm256_loadu_si256((const __m256i*)(row + 8 * v));
      __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
      __m256 o = _mm256_castsi256_ps(_mm256_and_si256(x, high));
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        s[r][v] = _mm256_fmadd_ps(a0[r], e, s[r][v]);
        s[r][v] = _mm256_fmadd_ps(a1[r], o, s[r][v]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(sums + r * P + 8 * v, s[r][v]);
}
// The panel widened to f32 (kc rows of 32), A f32: FloatPanel.
template <int R>
__attribute__((noinline)) void f32a(const float* a, long lda, long kc, const float* panel,
                                    float* sums) {
  __m256 s[R][4];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < 4; ++v) s[r][v] = _mm256_setzero_ps();
  for (long k = 0; k < kc; ++k) {
    const float* row = panel + k * P;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      __m256 x = _mm256_broadcast_ss(a + r * lda + k);
#pragma GCC unroll 8
      for (int v = 0; v < 4; ++v)
        s[r][v] = _mm256_fmadd_ps(x, _mm256_loadu_ps(row + 8 * v), s[r][v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(sums + r * P + 8 * v, s[r][v]);
}
// The panel widened to f32, A bf16 as pairs (broadcast, shift, mask a row and pair step).
template <int R>
__attribute__((noinline)) void bfa(const uint16_t* a, long lda, long kc, const float* panel,
                                   float* sums) {
  __m256 s[R][4];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < 4; ++v) s[r][v] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(0xffff0000u);
  for (long kp = 0; kp < kc / 2; ++kp) {
    const float* row = panel + 2 * kp * P;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t w;
      std::memcpy(&w, a + r * lda + 2 * kp, 4);
      __m256i x = _mm256_set1_epi32(w);
      __m256 a0 = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
#pragma GCC unroll 8
      for (int v = 0; v < 4; ++v)
        s[r][v] = _mm256_fmadd_ps(a0, _mm256_loadu_ps(row + 8 * v), s[r][v]);
      __m256 a1 = _mm256_castsi256_ps(_mm256_and_si256(x, high));
#pragma GCC unroll 8
      for (int v = 0; v < 4; ++v)
        s[r][v] = _mm256_fmadd_ps(a1, _mm256_loadu_ps(row + P + 8 * v), s[r][v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(sums + r * P + 8 * v, s[r][v]);
}
// The widening pass: kc / 2 pair rows to kc f32 rows.
__attribute__((noinline)) void widen(const uint32_t* panel, long kc, float* out) {
  const __m256i high = _mm256_set1_epi32(0xffff0000u);
  for (long kp = 0; kp < kc / 2; ++kp) {
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      __m256i x = _mm256_loadu_si256((const __m256i*)(panel + kp * P + 8 * v));
      _mm256_store_ps(out + 2 * kp * P + 8 * v, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
      _mm256_store_ps(out + (2 * kp + 1) * P + 8 * v,
                      _mm256_castsi256_ps(_mm256_and_si256(x, high)));
    }
  }
}
template <class F>
double best_of(F&& f) {
  double best = 1e9;
  for (int rep = 0; rep < 30; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < 10; ++it) f();
    best = std::min(
        best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 10);
  }
  return best;
}
int main() {
  for (long K : {1024L, 2048L}) {
    std::vector<uint32_t> panel(K / 2 * P + 64);
    for (size_t i = 0; i < panel.size(); ++i) panel[i] = 0x3f803f80u + (i % 7);
    float* wpanel = (float*)std::aligned_alloc(64, K * P * 4 + 256);
    for (long i = 0; i < K * P; ++i) wpanel[i] = (i % 7) * 0.01f;
    std::vector<uint16_t> a16(64 * K + 64, 0x3f80);
    std::vector<float> a32(64 * K + 64, 0.5f), sums(64 * P);
    auto report = [&](const char* name, long rows, double t) {
      double flop = 2.0 * rows * K * P;
      printf("%-34s K %5ld rows %3ld: %7.1f us, %5.1f GFLOP/s\n", name, K, rows, t * 1e6,
             flop / t * 1e-9);
    };
    for (long rows : {2L, 3L, 4L, 6L, 8L, 12L, 16L, 32L}) {
      // Today: rows < 8 whole panel in chunks of 2; from 8, halves in chunks of 4.
      report("wide 2x32 (today < 8 rows)", rows, best_of([&] {
               for (long r0 = 0; r0 < rows; r0 += 2) {
                 if (rows - r0 >= 2)
                   wide<2, 4>(a16.data() + r0 * K, K, K, panel.data(), sums.data());
                 else
                   wide<1, 4>(a16.data() + r0 * K, K, K, panel.data(), sums.data());
               }
             }));
      report("widev 2x32 (vectors outside rows)", rows, best_of([&] {
               for (long r0 = 0; r0 < rows; r0 += 2) {
                 if (rows - r0 >= 2)
                   widev<2, 4>(a16.data() + r0 * K, K, K, panel.data(), sums.data());
                 else
                   widev<1, 4>(a16.data() + r0 * K, K, K, panel.data(), sums.data());
               }
             }));
      report("widev 3x16 halves", rows, best_of([&] {
               for (int h = 0; h < 2; ++h)
                 for (long r0 = 0; r0 < rows; r0 += 3) {
                   if (rows - r0 >= 3)
                     widev<3, 2>(a16.data() + r0 * K, K, K, panel.data() + 16 * h, sums.data());
                   else if (rows - r0 == 2)
                     widev<2, 2>(a16.data() + r0 * K, K, K, panel.data() + 16 * h, sums.data());
                   else
                     widev<1, 2>(a16.data() + r0 * K, K, K, panel.data() + 16 * h, sums.data());
                 }
             }));
      report("wide halves 4x16 (today >= 8)", rows, best_of([&] {
               for (int h = 0; h < 2; ++h)
                 for (long r0 = 0; r0 < rows; r0 += 4)
                   wide<4, 2>(a16.data() + r0 * K, K, K, panel.data() + 16 * h, sums.data());
             }));
      auto chunks = [&](auto kern) {
        long n = (rows + 2) / 3;
        for (long c = 0; c < n; ++c) {
          long r0 = rows * c / n, r1 = rows * (c + 1) / n;
          kern(r0, r1 - r0);
        }
      };
      report("widen + f32 A 3x32", rows, best_of([&] {
               widen(panel.data(), K, wpanel);
               chunks([&](long r0, long n) {
                 if (n == 3)
                   f32a<3>(a32.data() + r0 * K, K, K, wpanel, sums.data());
                 else if (n == 2)
                   f32a<2>(a32.data() + r0 * K, K, K, wpanel, sums.data());
                 else
                   f32a<1>(a32.data() + r0 * K, K, K, wpanel, sums.data());
               });
             }));
      report("widen + bf16 A 3x32", rows, best_of([&] {
               widen(panel.data(), K, wpanel);
               chunks([&](long r0, long n) {
                 if (n == 3)
                   bfa<3>(a16.data() + r0 * K, K, K, wpanel, sums.data());
                 else if (n == 2)
                   bfa<2>(a16.data() + r0 * K, K, K, wpanel, sums.data());
                 else
                   bfa<1>(a16.data() + r0 * K, K, K, wpanel, sums.data());
               });
             }));
    }
    report("widen alone", 1, best_of([&] { widen(panel.data(), K, wpanel); }));
    free(wpanel);
  }
}
