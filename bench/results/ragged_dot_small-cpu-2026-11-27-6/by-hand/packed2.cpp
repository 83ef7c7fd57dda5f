// By hand, not in the library: the forward's f32 kernel on a packed panel, redone. The first
// version (../../ragged_dot_small-cpu-2026-11-27-5/by-hand/packed.cpp, 63-82 GFLOP/s) kept its
// 12 sums in a stack array, stored every step (GCC 12 does so without `#pragma GCC unroll` on
// the loops that load and store them: the library's comment on its kernels says the same); here
// every loop over the sums is unrolled and the sums stay in registers.
//
// Per thread (two, OpenMP), bf16 weights [K][n] (in L2/L3 after the first rep: "warm") and R rows
// in chunks of 6, their sums [R][n] f32. For each block of KB contraction rows and each 16-column
// panel: the panel widened into a contiguous f32 copy [KB][16] (in L1), then each chunk's 6 x 2
// sums over the KB steps, loaded and stored once per (block, panel, chunk). Variant bits:
//   0 / 1: the rows' elements broadcast from A packed [K][6] per chunk / from 6 rows K apart
//   2:     a counter per step besides (as the library's spread prefetches count their steps)
//   4:     the next block's lines prefetched, 8 per kernel call (in row order)
//   8:     the block packed row by row into [panels][KB][16] before the panels run (rather than
//          each panel in turn from its KB rows 2n bytes apart)
// Prints the median of 30 runs, GFLOP/s on both threads.
//   g++ -O2 -march=haswell -fopenmp packed2.cpp -o packed2; packed2 KB R n K variant
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

template <int V>
__attribute__((noinline)) void chunk6(const float* pan, const float* ap, int lda, int kb,
                                      float* sums, int ld, int* ctr) {
  __m256 s[6][2];
#pragma GCC unroll 6
  for (int r = 0; r < 6; ++r)
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) s[r][i] = _mm256_loadu_ps(sums + r * ld + 8 * i);
  int c = *ctr;
  for (int k = 0; k < kb; ++k) {
    if (V == 2 && --c == 0) {
      c = 1000;
      __builtin_prefetch(pan + 4096);
    }
    const __m256 b0 = _mm256_loadu_ps(pan + k * 16), b1 = _mm256_loadu_ps(pan + k * 16 + 8);
#pragma GCC unroll 6
    for (int r = 0; r < 6; ++r) {
      const __m256 a = _mm256_broadcast_ss(V == 0 ? ap + k * 6 + r : ap + r * lda + k);
      s[r][0] = _mm256_fmadd_ps(a, b0, s[r][0]);
      s[r][1] = _mm256_fmadd_ps(a, b1, s[r][1]);
    }
  }
  *ctr = c;
#pragma GCC unroll 6
  for (int r = 0; r < 6; ++r)
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) _mm256_storeu_ps(sums + r * ld + 8 * i, s[r][i]);
}

static __m256 widen(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

int main(int argc, char** argv) {
  if (argc < 6) return std::printf("packed2 KB R n K variant\n"), 1;
  const int KB = atoi(argv[1]), R = atoi(argv[2]), n = atoi(argv[3]), K = atoi(argv[4]),
            var = atoi(argv[5]), chunks = R / 6, np = n / 16;
  const bool pf = var & 4, row_order = var & 8;
  std::vector<double> ts;
  for (int rep = 0; rep < 30; ++rep) {
    double t0 = 0;
#pragma omp parallel
    {
      static thread_local std::vector<uint16_t> w(size_t(K) * n, 0x3f80);
      static thread_local std::vector<float> ap(size_t(chunks) * K * 6, 1.0f),
          sums(size_t(R) * n, 0.f), packed(size_t(KB) * n);
      alignas(64) static thread_local float pan[256 * 16];
      int ctr = 1000;
#pragma omp barrier
#pragma omp master
      t0 = omp_get_wtime();
#pragma omp barrier
      for (int k0 = 0; k0 < K; k0 += KB) {
        // The next block (the first after the last: warm anyway), 8 lines per kernel call.
        const char* next = reinterpret_cast<const char*>(w.data() + size_t((k0 + KB) % K) * n);
        const size_t lines = size_t(KB) * n * 2 / 64;
        size_t line = 0;
        if (row_order) {
          for (int k = 0; k < KB; ++k) {
            const uint16_t* src = w.data() + size_t(k0 + k) * n;
            for (int p = 0; p < np; ++p) {
              float* dst = packed.data() + (size_t(p) * KB + k) * 16;
              _mm256_storeu_ps(dst, widen(src + p * 16));
              _mm256_storeu_ps(dst + 8, widen(src + p * 16 + 8));
            }
          }
        }
        for (int p = 0; p < np; ++p) {
          const float* pn = row_order ? packed.data() + size_t(p) * KB * 16 : pan;
          if (!row_order) {
            for (int k = 0; k < KB; ++k) {
              const uint16_t* src = w.data() + size_t(k0 + k) * n + p * 16;
              _mm256_store_ps(pan + k * 16, widen(src));
              _mm256_store_ps(pan + k * 16 + 8, widen(src + 8));
            }
          }
          for (int c = 0; c < chunks; ++c) {
            for (int q = 0; pf && q < 8 && line < lines; ++q, ++line)
              __builtin_prefetch(next + line * 64);
            float* sm = sums.data() + size_t(c) * 6 * n + p * 16;
            if ((var & 3) == 0) {
              chunk6<0>(pn, ap.data() + (size_t(c) * K + k0) * 6, K, KB, sm, n, &ctr);
            } else if ((var & 3) == 1) {
              chunk6<1>(pn, ap.data() + size_t(c) * 6 * K + k0, K, KB, sm, n, &ctr);
            } else {
              chunk6<2>(pn, ap.data() + size_t(c) * 6 * K + k0, K, KB, sm, n, &ctr);
            }
          }
        }
      }
#pragma omp barrier
#pragma omp master
      ts.push_back(omp_get_wtime() - t0);
    }
  }
  std::sort(ts.begin(), ts.end());
  const double t = ts[ts.size() / 2], flops = 2.0 * R * K * n * omp_get_max_threads();
  std::printf("v%-2d KB %3d R %2d n %4d K %d: %.3f ms, %.0f GFLOP/s\n", var, KB, R, n, K, t * 1e3,
              flops / t / 1e9);
}
