// Kernel cycles per step: R rows x C columns of a 32-wide f32 panel, data in L1/L2.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
constexpr int P = 32;
// Whole-panel 2-row, loads folded (as GCC emits today) or forced into registers.
template <int R, int V, bool kRegs>
__attribute__((noinline)) void kern(const float* a, long lda, long kc, const float* panel,
                                    float* sums) {
  __m256 s[R][V];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) s[r][v] = _mm256_setzero_ps();
  for (long k = 0; k < kc; ++k) {
    const float* row = panel + k * P;
    __m256 b[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      b[v] = _mm256_loadu_ps(row + 8 * v);
      if constexpr (kRegs) __asm__("" : "+x"(b[v]));
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      __m256 x = _mm256_broadcast_ss(a + r * lda + k);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) s[r][v] = _mm256_fmadd_ps(x, b[v], s[r][v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(sums + r * P + 8 * v, s[r][v]);
}
template <int R, int V, bool kRegs>
void run(const char* name, long K, long rows_total, long lda) {
  // rows_total rows in chunks of R over a panel of K steps; V vectors (V=2: halves, two passes).
  std::vector<float> panel(K * P + 64), a(rows_total * lda + 64), sums(64 * P);
  for (size_t i = 0; i < panel.size(); ++i) panel[i] = (i % 7) * 0.01f;
  for (size_t i = 0; i < a.size(); ++i) a[i] = (i % 5) * 0.01f;
  const int halves = 4 / V;
  double best = 1e9;
  for (int rep = 0; rep < 50; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < 20; ++it)
      for (int h = 0; h < halves; ++h)
        for (long r0 = 0; r0 < rows_total; r0 += R)
          kern<R, V, kRegs>(a.data() + r0 * lda, lda, K, panel.data() + h * 8 * V, sums.data());
    double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 20;
    best = std::min(best, t);
  }
  double fmas = (double)rows_total * K * 4;  // 8-lane FMAs
  printf("%-22s K %5ld rows %3ld lda %6ld: %.2f ns/step-row-panel, %.1f GFLOP/s, %.2f FMA/ns\n",
         name, K, rows_total, lda, best / (K * rows_total) * 1e9, fmas * 16 / best * 1e-9,
         fmas / best * 1e-9);
}
int main(int argc, char** argv) {
  long lda = argc > 1 ? atol(argv[1]) : 0;
  for (long K : {256L, 2048L}) {
    long l = lda ? lda : K;
    run<2, 4, false>("2x32 folded", K, 2, l);
    run<2, 4, true>("2x32 regs", K, 2, l);
    run<2, 4, false>("2x32 folded x8", K, 16, l);
    run<2, 4, true>("2x32 regs x8", K, 16, l);
    run<6, 2, false>("6x16 halves", K, 6, l);
    run<6, 2, true>("6x16 halves regs", K, 6, l);
    run<6, 2, true>("6x16 halves regs", K, 18, l);
    run<3, 4, false>("3x32 folded", K, 3, l);
    run<4, 2, true>("4x16 regs", K, 4, l);
    run<1, 4, true>("1x32 regs", K, 1, l);
  }
}
