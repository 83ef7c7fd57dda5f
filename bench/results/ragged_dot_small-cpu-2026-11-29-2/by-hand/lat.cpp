// vdpbf16ps and vfmadd231ps on zmm: per ns with 1-24 independent chains (latency and throughput).
//   g++ -O2 -std=c++20 lat.cpp -o lat
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#define TGT __attribute__((target("avx512f,avx512bw,avx512bf16")))
template <int C>
TGT __attribute__((noinline)) double run(long n) {
  __m512 s[C];
  for (int i = 0; i < C; ++i) s[i] = _mm512_set1_ps(i);
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x00010001);
  auto t = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) {
#pragma GCC unroll 32
    for (int c = 0; c < C; ++c) s[c] = _mm512_dpbf16_ps(s[c], a, b);
    asm volatile("" : "+v"(a));
  }
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  float sum = 0;
  for (int c = 0; c < C; ++c) sum += _mm512_reduce_add_ps(s[c]);
  if (sum == 1.2345f) puts("");
  return n * C / dt / 1e9;  // dpbf16 per ns
}
template <int C>
TGT __attribute__((noinline)) double fma(long n) {
  __m512 s[C];
  for (int i = 0; i < C; ++i) s[i] = _mm512_set1_ps(i);
  __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-9f);
  auto t = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) {
#pragma GCC unroll 32
    for (int c = 0; c < C; ++c) s[c] = _mm512_fmadd_ps(a, b, s[c]);
    asm volatile("" : "+v"(a));
  }
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  float sum = 0;
  for (int c = 0; c < C; ++c) sum += _mm512_reduce_add_ps(s[c]);
  if (sum == 1.2345f) puts("");
  return n * C / dt / 1e9;
}
int main() {
  long n = 200000000;
  printf("dpbf16 zmm per ns: 1 chain %.2f, 2 %.2f, 4 %.2f, 8 %.2f, 12 %.2f, 16 %.2f, 24 %.2f\n",
         run<1>(n), run<2>(n), run<4>(n / 2), run<8>(n / 4), run<12>(n / 4), run<16>(n / 8),
         run<24>(n / 8));
  printf("fma zmm per ns:    1 chain %.2f, 2 %.2f, 4 %.2f, 8 %.2f, 12 %.2f, 16 %.2f, 24 %.2f\n",
         fma<1>(n), fma<2>(n), fma<4>(n / 2), fma<8>(n / 4), fma<12>(n / 4), fma<16>(n / 8),
         fma<24>(n / 8));
}
