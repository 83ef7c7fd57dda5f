// By hand (a first look at a packed kernel for 16+ rows a group, not in the library): the
// forward's f32 kernel on a packed panel. Per thread (two, OpenMP), bf16 weights [K 256][n 2048]
// (4 KiB rows, 1 MiB: in L2/L3 after the first rep) and R rows in chunks of 6; for each block of
// KB contraction rows and each 16-column panel: the panel widened into a contiguous f32 copy
// [KB][16] (in L1), then each chunk's 6 x 2 sums over the KB steps, loaded and stored once per
// (block, panel, chunk). Prints GFLOP/s on both threads, best of 30 runs.
//   g++ -O2 -march=haswell -fopenmp packed.cpp -o packed; packed KB R
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

constexpr int K = 256, n = 2048;

__attribute__((noinline)) void chunk6(const float* pan, const float* ap, int kb, float* sums,
                                      int ld) {
  __m256 s[6][2];
  for (int r = 0; r < 6; ++r)
    for (int i = 0; i < 2; ++i) s[r][i] = _mm256_loadu_ps(sums + r * ld + 8 * i);
  for (int k = 0; k < kb; ++k) {
    const __m256 b0 = _mm256_load_ps(pan + k * 16), b1 = _mm256_load_ps(pan + k * 16 + 8);
#pragma GCC unroll 6
    for (int r = 0; r < 6; ++r) {
      const __m256 a = _mm256_broadcast_ss(ap + k * 6 + r);
      s[r][0] = _mm256_fmadd_ps(a, b0, s[r][0]);
      s[r][1] = _mm256_fmadd_ps(a, b1, s[r][1]);
    }
  }
  for (int r = 0; r < 6; ++r)
    for (int i = 0; i < 2; ++i) _mm256_storeu_ps(sums + r * ld + 8 * i, s[r][i]);
}

static __m256 widen(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

int main(int argc, char** argv) {
  const int KB = atoi(argv[1]), R = atoi(argv[2]), chunks = R / 6;
  double best = 1e9;
  for (int rep = 0; rep < 30; ++rep) {
    double t0 = 0;
#pragma omp parallel
    {
      static thread_local std::vector<uint16_t> w(size_t(K) * n, 0x3f80);
      static thread_local std::vector<float> ap(size_t(chunks) * K * 6, 1.0f),
          sums(size_t(R) * n, 0.f);
      alignas(64) static thread_local float pan[256 * 16];
#pragma omp barrier
#pragma omp master
      t0 = omp_get_wtime();
#pragma omp barrier
      for (int k0 = 0; k0 < K; k0 += KB) {
        for (int p = 0; p < n / 16; ++p) {
          for (int k = 0; k < KB; ++k) {
            const uint16_t* src = w.data() + size_t(k0 + k) * n + p * 16;
            _mm256_store_ps(pan + k * 16, widen(src));
            _mm256_store_ps(pan + k * 16 + 8, widen(src + 8));
          }
          for (int c = 0; c < chunks; ++c)
            chunk6(pan, ap.data() + (size_t(c) * K + k0) * 6, KB,
                   sums.data() + size_t(c) * 6 * n + p * 16, n);
        }
      }
#pragma omp barrier
#pragma omp master
      best = std::min(best, omp_get_wtime() - t0);
    }
  }
  const double flops = 2.0 * R * K * n * omp_get_max_threads();
  std::printf("KB %d R %d: %.3f ms, %.0f GFLOP/s\n", KB, R, best * 1e3, flops / best / 1e9);
}
