// Memory stream + bf16 dots in super-blocks: each thread walks its half of 1 GiB in super-blocks
// of SB bytes; the next super-block is prefetched, spread over the current one's C passes (a line
// every C); each pass runs the products of RP rows against L weight lines at a time (RP x L sums in
// registers), as DotItem's chunks do. Compute only: every super-block read from the same (cached)
// address. Prints ms for each RP x L, C.
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

template <int RP, int L>
__attribute__((noinline)) __m512 pass(const char* sb, size_t bytes, const char* next,
                                      size_t every) {
  __m512 acc[RP][L];
  for (int i = 0; i < RP; ++i)
    for (int j = 0; j < L; ++j) acc[i][j] = _mm512_setzero_ps();
  const __m512i r0 = _mm512_set1_epi32(0x3f803f80), r1 = _mm512_set1_epi32(0x3f813f80);
  size_t pf = 0, l = 0;
  for (size_t off = 0; off < bytes; off += 64 * L, ++l) {
    if (every)
      for (int j = 0; j < L; ++j)
        if ((l * L + j) % every == 0) {
          _mm_prefetch(next + pf, _MM_HINT_T0);
          pf += 64;
        }
    __m512i w[L];
    for (int j = 0; j < L; ++j) w[j] = _mm512_load_si512(sb + off + 64 * j);
#pragma GCC unroll 32
    for (int i = 0; i < RP; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < L; ++j)
        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)w[j], (__m512bh)(i & 1 ? r1 : r0));
  }
  __m512 s = _mm512_setzero_ps();
  for (int i = 0; i < RP; ++i)
    for (int j = 0; j < L; ++j) s = _mm512_add_ps(s, acc[i][j]);
  return s;
}

template <int RP, int L>
double run(char* buf, size_t total, size_t SB, int C, bool cached) {
  auto t0 = std::chrono::steady_clock::now();
  volatile float keep = 0;
#pragma omp parallel
  {
    const int n = omp_get_num_threads(), id = omp_get_thread_num();
    const size_t part = total / n;
    const char* b = buf + id * part;
    __m512 s = _mm512_setzero_ps();
    for (size_t o = 0; o < part; o += SB) {
      const char* cur = cached ? b : b + o;
      for (int c = 0; c < C; ++c)
        s = _mm512_add_ps(s, pass<RP, L>(cur, SB, cur + SB + c * (SB / C), cached ? 0 : C));
    }
    keep = keep + _mm512_reduce_add_ps(s);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e3;
}

#define V(RP, L, C)                                                                            \
  printf("%2dx%d C=%d: %.1f (compute %.1f)  ", RP, L, C, run<RP, L>(buf, total, SB, C, false), \
         run<RP, L>(buf, total, SB, C, true))
int main() {
  const size_t total = size_t(1) << 30;
  char* buf = static_cast<char*>(aligned_alloc(4096, total + (1 << 20)));
  memset(buf, 1, total + (1 << 20));
  const size_t SB = 128 << 10;
  for (int round = 0; round < 2; ++round) {
    printf("read %.1f\n", run<1, 1>(buf, total, SB, 1, false));
    V(18, 1, 1);
    V(16, 1, 1);
    V(8, 2, 2);
    V(9, 2, 2);
    printf("\n");
    V(6, 4, 3);
    V(6, 3, 3);
    V(6, 2, 3);
    V(12, 2, 2);
    printf("\n");
    V(4, 4, 4);
    V(12, 1, 1);
    V(24, 1, 1);
    printf("\n");
  }
}
