// By hand: 1200 MiB of weight rows of `row` bytes read by 2 threads (each a contiguous half) in
// blocks of `kb` rows, in one of these orders (each config timed in turn, 9 times, median):
//   0: each block front to back (a sequential read)
//   1: each block panel by panel (128 bytes of each of its rows, then the next 128), the next
//      block prefetched (prefetcht0) in storage order, spread over the panels
//   2: as 1, the next block prefetched in panel order
//   3: as 0, the next block prefetched as it goes
//   5: as 1, the block after next prefetched into L2 (prefetcht1) instead
//   read_order row mode kb [mode kb ...]
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv) {
  if (argc < 4 || argc % 2 != 0) {
    std::fprintf(stderr, "usage: %s row mode kb [mode kb ...]\n", argv[0]);
    return 2;
  }
  const size_t rb = atoi(argv[1]);
  const int configs = (argc - 2) / 2;
  const size_t rows = (size_t{1200} << 20) / rb / 16 * 16;
  char* w = static_cast<char*>(aligned_alloc(4096, rows * rb));
  std::memset(w, 1, rows * rb);
  std::vector<std::vector<double>> times(configs);
  for (int rep = 0; rep < 9; ++rep) {
    for (int cfg = 0; cfg < configs; ++cfg) {
      const int mode = atoi(argv[2 + 2 * cfg]);
      const size_t kb = atoi(argv[3 + 2 * cfg]);
      const double t = now();
      __m512i total = _mm512_setzero_si512();
#pragma omp parallel
      {
        const size_t th = omp_get_thread_num(), nt = omp_get_num_threads();
        const size_t r0 = rows * th / nt / kb * kb, r1 = rows * (th + 1) / nt / kb * kb;
        __m512i acc = _mm512_setzero_si512();
        for (size_t k0 = r0; k0 < r1; k0 += kb) {
          const char* blk = w + k0 * rb;
          const char* next = blk + kb * rb;
          const size_t lines = kb * rb / 64, panels = rb / 128, per = (lines + panels - 1) / panels;
          if (mode == 0 || mode == 3) {
            for (size_t i = 0; i < kb * rb; i += 128) {
              if (mode == 3) __builtin_prefetch(next + i), __builtin_prefetch(next + i + 64);
              acc = _mm512_add_epi32(acc, _mm512_load_si512(blk + i));
              acc = _mm512_add_epi32(acc, _mm512_load_si512(blk + i + 64));
            }
            continue;
          }
          size_t line = 0;
          for (size_t p = 0; p < panels; ++p) {
            if (mode == 1) {
              for (size_t l = 0; l < per && line < lines; ++l, ++line)
                __builtin_prefetch(next + line * 64);
            } else if (mode == 2) {
              for (size_t k = 0; k < kb; ++k) {
                __builtin_prefetch(next + k * rb + p * 128);
                __builtin_prefetch(next + k * rb + p * 128 + 64);
              }
            } else if (mode == 5) {
              for (size_t l = 0; l < per && line < lines; ++l, ++line)
                __builtin_prefetch(next + kb * rb + line * 64, 0, 2);
            }
            for (size_t k = 0; k < kb; ++k) {
              acc = _mm512_add_epi32(acc, _mm512_load_si512(blk + k * rb + p * 128));
              acc = _mm512_add_epi32(acc, _mm512_load_si512(blk + k * rb + p * 128 + 64));
            }
          }
        }
#pragma omp critical
        total = _mm512_add_epi32(total, acc);
      }
      times[cfg].push_back(now() - t);
      if (_mm512_reduce_add_epi32(total) == 42) std::puts("");
    }
  }
  for (int cfg = 0; cfg < configs; ++cfg) {
    std::sort(times[cfg].begin(), times[cfg].end());
    std::printf("row %zu mode %s kb %s: %.1f GB/s\n", rb, argv[2 + 2 * cfg], argv[3 + 2 * cfg],
                rows * rb / times[cfg][4] / 1e9);
  }
}
