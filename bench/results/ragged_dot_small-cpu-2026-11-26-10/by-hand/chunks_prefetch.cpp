// chunks.cpp's stream and passes, with super-blocks of 16 KiB (in L1) and 128 KiB, and the next
// super-block's prefetches as chunks.cpp spreads them (a line every C lines of each pass, hint 0-3:
// T0, T1, T2, NTA), all in the first pass ("first-pass pf"), or none ("no sw pf"). RP x L rows x
// weight lines of sums a pass, C passes; ms for 1 GiB over two threads.
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

static int HINT = 0;
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
          if (HINT == 0)
            _mm_prefetch(next + pf, _MM_HINT_T0);
          else if (HINT == 1)
            _mm_prefetch(next + pf, _MM_HINT_T1);
          else if (HINT == 2)
            _mm_prefetch(next + pf, _MM_HINT_T2);
          else
            _mm_prefetch(next + pf, _MM_HINT_NTA);
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

static int FIRST = 0, NOPF = 0;
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
        s = _mm512_add_ps(s,
                          pass<RP, L>(cur, SB, cur + SB + (FIRST ? 0 : c * (SB / C)),
                                      (cached || NOPF || (FIRST && c > 0)) ? 0 : (FIRST ? 1 : C)));
    }
    keep = keep + _mm512_reduce_add_ps(s);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e3;
}

#define V(RP, L, C) printf("%2dx%d C=%d: %.1f  ", RP, L, C, run<RP, L>(buf, total, SB, C, false))
int main() {
  const size_t total = size_t(1) << 30;
  char* buf = static_cast<char*>(aligned_alloc(4096, total + (1 << 20)));
  memset(buf, 1, total + (1 << 20));
  for (int round = 0; round < 2; ++round) {
    for (size_t SB : {size_t(16) << 10, size_t(128) << 10}) {
      printf("SB %zu read %.1f\n", SB >> 10, run<1, 1>(buf, total, SB, 1, false));
      for (int h = 0; h < 4; ++h) {
        HINT = h;
        printf(" hint %d: ", h);
        V(18, 1, 1);
        V(6, 4, 3);
        V(8, 2, 2);
        printf("\n");
      }
      HINT = 0;
      FIRST = 1;
      printf(" first-pass pf: ");
      V(18, 1, 1);
      V(6, 4, 3);
      V(8, 2, 2);
      printf("\n");
      FIRST = 0;
      NOPF = 1;
      printf(" no sw pf: ");
      V(18, 1, 1);
      V(6, 4, 3);
      V(8, 2, 2);
      printf("\n");
      NOPF = 0;
    }
  }
}
