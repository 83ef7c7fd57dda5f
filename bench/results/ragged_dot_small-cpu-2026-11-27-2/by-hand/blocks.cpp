// kCpuStream's bf16 forward on AVX2 with several chunks of rows, by hand: weights [rows][768] bf16
// (1536-byte rows, 384 MiB, qwen3-30b-a3b's), in blocks of KB weight rows (85: the kernel's 128
// KiB); each block a chunk of 6 rows and one of SECOND rows (2, 4 or 0), over 48 panels of 16
// columns, each panel down the block's rows, the sums (rows x 2 vectors) loaded and stored once a
// panel; mode 1: every chunk over all panels in turn, mode 4: every chunk on a panel in turn (the
// kernel's order), mode 0: no prefetch. The next block's lines are prefetched in order, one every
// EVERY steps (a step: one weight row of a panel) from the block's first step until all are out.
// "mem": each block once (weights from memory); "l1-ish": the first block over and over (from L2,
// no prefetch: the FMAs' time). Two OpenMP threads, each its half of the weights.
//   [AHEAD=n] blocks MODE [KB [SECOND [EVERY]]]   (AHEAD: prefetch the block n ahead, default 1)
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

constexpr int kCols = 768, kRowBytes = kCols * 2, kPanels = kCols / 16;
static inline __m256 widen(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
template <int R>
__attribute__((noinline)) void chunk(int p0, int p1, const uint16_t* blk, int kb, const float* a,
                                     float* sums, const char*& pf, int& pf_left, int every,
                                     int& tick) {
  for (int p = p0; p < p1; ++p) {
    __m256 s[R][2];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 2; ++i) s[r][i] = _mm256_loadu_ps(sums + r * kCols + p * 16 + i * 8);
    for (int k = 0; k < kb; ++k) {
      if (pf_left > 0 && ++tick >= every) {
        tick = 0;
        _mm_prefetch(pf, _MM_HINT_T0);
        pf += 64;
        --pf_left;
      }
      const uint16_t* row = blk + (size_t)k * kCols + p * 16;
      __m256 b0 = widen(row), b1 = widen(row + 8);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 av = _mm256_set1_ps(a[r * 2048 + k]);
        s[r][0] = _mm256_fmadd_ps(av, b0, s[r][0]);
        s[r][1] = _mm256_fmadd_ps(av, b1, s[r][1]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 2; ++i) _mm256_storeu_ps(sums + r * kCols + p * 16 + i * 8, s[r][i]);
  }
}
int main(int argc, char** argv) {
  const int mode = atoi(argv[1]);
  const int kb = argc > 2 ? atoi(argv[2]) : 85;
  const int second = argc > 3 ? atoi(argv[3]) : 2;  // rows of the second chunk (0: none)
  const int every = argc > 4 ? atoi(argv[4]) : 1;
  const size_t ahead = getenv("AHEAD") ? atoi(getenv("AHEAD")) : 1;  // blocks ahead
  const size_t rows_total = (size_t(384) << 20) / kRowBytes;
  std::vector<uint16_t> w(rows_total * kCols, 0x3f80);
  const int threads = omp_get_max_threads();
  double best[2] = {1e9, 1e9};
  for (int rep = 0; rep < 5; ++rep)
    for (int l1 = 0; l1 < 2; ++l1) {
      auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel
      {
        std::vector<float> a(8 * 2048, 1.0f), sums(8 * kCols, 0.0f);
        const size_t per = rows_total / threads, first = omp_get_thread_num() * per;
        const size_t blocks = per / kb;
        for (size_t b = 0; b < blocks; ++b) {
          const uint16_t* blk = w.data() + (first + (l1 ? 0 : b * kb)) * kCols;
          const char* pf = reinterpret_cast<const char*>(blk + (size_t)kb * kCols * ahead);
          int pf_left = (l1 || mode == 0) ? 0 : kb * kRowBytes / 64;
          int tick = 0;
          if (mode == 4) {
            for (int p = 0; p < kPanels; ++p) {
              chunk<6>(p, p + 1, blk, kb, a.data(), sums.data(), pf, pf_left, every, tick);
              if (second == 2)
                chunk<2>(p, p + 1, blk, kb, a.data(), sums.data(), pf, pf_left, every, tick);
            }
          } else {
            chunk<6>(0, kPanels, blk, kb, a.data(), sums.data(), pf, pf_left, every, tick);
            if (second == 2)
              chunk<2>(0, kPanels, blk, kb, a.data(), sums.data(), pf, pf_left, every, tick);
            if (second == 4)
              chunk<4>(0, kPanels, blk, kb, a.data(), sums.data(), pf, pf_left, every, tick);
          }
        }
        if (sums[3] == 12345) std::printf(" ");
      }
      double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (ms < best[l1]) best[l1] = ms;
    }
  const double bytes = double(rows_total) * kRowBytes;
  const double flops = 2.0 * (6 + second) * rows_total * kCols;
  std::printf(
      "every %d mode %d kb %d rows 6+%d: mem %.1f ms (%.1f GB/s, %.0f GF) | l1-ish %.1f ms (%.0f "
      "GF)\n",
      every, mode, kb, second, best[0], bytes / best[0] / 1e6, flops / best[0] / 1e6, best[1],
      flops / best[1] / 1e6);
}
