// Steps per ns of C chained vdpbf16ps beside U independent vpunpck[lh]wd: do the unpacks cost FMA
// slots?
//   g++ -O2 -std=c++20 unp.cpp -o unp
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#define TGT __attribute__((target("avx512f,avx512bw,avx512bf16")))
// per step: U unpacks (independent) + D dpbf16 over C chains
template <int C, int U>
TGT __attribute__((noinline)) double run(long n) {
  __m512 s[C];
  for (int i = 0; i < C; ++i) s[i] = _mm512_set1_ps(i);
  __m512i x = _mm512_set1_epi32(0x3f803f80), y = _mm512_set1_epi32(0x00010001);
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  auto t = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) {
    __m512i v[U > 0 ? U : 1];
#pragma GCC unroll 32
    for (int u = 0; u < U; ++u)
      v[u] = (u % 2) ? _mm512_unpackhi_epi16(x, y) : _mm512_unpacklo_epi16(x, y);
#pragma GCC unroll 32
    for (int c = 0; c < C; ++c)
      s[c] = _mm512_dpbf16_ps(s[c], a, (__m512bh)(U > 0 ? v[c % (U > 0 ? U : 1)] : y));
    asm volatile("" : "+v"(x), "+v"(y));
  }
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  float sum = 0;
  for (int c = 0; c < C; ++c) sum += _mm512_reduce_add_ps(s[c]);
  if (sum == 1.2345f) puts("");
  return n / dt / 1e9;  // steps per ns
}
int main() {
  long n = 100000000;
  printf(
      "steps/ns: C8 U0 %.3f | C8 U2 %.3f | C8 U4 %.3f | C8 U8 %.3f | C16 U4 %.3f | C16 U8 %.3f | "
      "C4 U4 %.3f | C24 U4 %.3f\n",
      run<8, 0>(n), run<8, 2>(n), run<8, 4>(n), run<8, 8>(n), run<16, 4>(n), run<16, 8>(n),
      run<4, 4>(n), run<24, 4>(n));
}
