// Does a core overlap a memory stream with bf16 dot products? Each of T threads walks its part of
// a buffer larger than the caches, 64 bytes at a time, and runs R vdpbf16ps on each line against R
// row registers (the rows' sums in registers, as kCpuStream does). mode 0: lines from memory;
// mode 1: lines from a 32 KiB L1-resident buffer (compute only); R = 0: the read only.
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

template <int R>
__attribute__((noinline)) float run(const char* base, size_t bytes, bool l1, int pf) {
  __m512 acc[R > 0 ? R : 1];
  for (int i = 0; i < (R > 0 ? R : 1); ++i) acc[i] = _mm512_setzero_ps();
  __m512 sink = _mm512_setzero_ps();
  const __m512i r0 = _mm512_set1_epi32(0x3f803f80), r1 = _mm512_set1_epi32(0x3f813f80);
  for (size_t off = 0; off < bytes; off += 64) {
    const char* p = l1 ? base + (off & 32767) : base + off;
    if (pf && !l1) _mm_prefetch(base + off + pf, _MM_HINT_T0);
    __m512i w = _mm512_load_si512(p);
    if constexpr (R == 0) {
      sink = _mm512_add_ps(sink, _mm512_castsi512_ps(w));
    } else {
#pragma GCC unroll 64
      for (int i = 0; i < R; ++i)
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)w, (__m512bh)(i & 1 ? r1 : r0));
    }
  }
  for (int i = 0; i < (R > 0 ? R : 1); ++i) sink = _mm512_add_ps(sink, acc[i]);
  return _mm512_reduce_add_ps(sink);
}

int main(int argc, char** argv) {
  const size_t total = size_t(1) << 30;
  char* buf = static_cast<char*>(aligned_alloc(4096, total));
  memset(buf, 1, total);
  const int pfs[] = {0, 1024, 4096};
  volatile float keep = 0;
  for (int round = 0; round < 3; ++round) {
    for (int R : {0, 16, 20, 24, 28}) {
      for (int pf : pfs) {
        double t[2];
        for (int l1 = 0; l1 < 2; ++l1) {
          if (R == 0 && l1) {
            t[1] = 0;
            continue;
          }
          if (pf && l1) {
            t[1] = -1;
            continue;
          }
          auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel reduction(+ : keep)
          {
            const int n = omp_get_num_threads(), id = omp_get_thread_num();
            const size_t part = total / n;
            const char* b = buf + id * part;
            float v = 0;
            switch (R) {
              case 0:
                v = run<0>(b, part, l1, pf);
                break;
              case 4:
                v = run<4>(b, part, l1, pf);
                break;
              case 8:
                v = run<8>(b, part, l1, pf);
                break;
              case 20:
                v = run<20>(b, part, l1, pf);
                break;
              case 28:
                v = run<28>(b, part, l1, pf);
                break;
              case 16:
                v = run<16>(b, part, l1, pf);
                break;
              case 24:
                v = run<24>(b, part, l1, pf);
                break;
            }
            keep += v;
          }
          t[l1] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        }
        printf("round %d R %2d pf %4d  mem+compute %.1f ms (%.1f GB/s)  compute-only %.1f ms\n",
               round, R, pf, t[0] * 1e3, total / t[0] / 1e9, t[1] * 1e3);
      }
    }
  }
  return keep == 12345.f;
}
