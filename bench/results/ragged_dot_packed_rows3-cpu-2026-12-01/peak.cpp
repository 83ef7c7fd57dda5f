#include <immintrin.h>

#include <chrono>
#include <cstdio>
int main() {
  __m256 s[12];
  for (int i = 0; i < 12; ++i) s[i] = _mm256_set1_ps(i * 0.001f);
  __m256 a = _mm256_set1_ps(0.9999f), b = _mm256_set1_ps(0.0001f);
  const long N = 200000000;
  auto t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < N; ++k) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) s[i] = _mm256_fmadd_ps(a, s[i], b);
    __asm__ volatile("" : "+x"(a));
  }
  double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float x = 0;
  for (int i = 0; i < 12; ++i) x += _mm256_cvtss_f32(s[i]);
  printf("%.1f GFLOP/s (one core), %.2f G FMA-instr/s  [%f]\n", N * 12 * 16 / t * 1e-9,
         N * 12 / t * 1e-9, x);
}
