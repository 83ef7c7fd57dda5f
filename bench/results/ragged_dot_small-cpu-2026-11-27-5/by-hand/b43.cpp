// 8 rows as 4 + 4 on 4 rows x 3 vectors (24-column panels), panel-interleaved (the second chunk
// reads the panel from L1), against blocks.cpp's 6 + 2. weights [rows][768] bf16 as blocks.cpp.
//   b43 KB EVERY
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
constexpr int kCols = 768, kRowBytes = kCols * 2;
static inline __m256 widen(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
template <int R, int V>
__attribute__((noinline)) void panel(int c0, const uint16_t* blk, int kb, const float* a,
                                     float* sums, const char*& pf, int& pf_left, int every,
                                     int& tick) {
  __m256 s[R][V];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < V; ++i) s[r][i] = _mm256_loadu_ps(sums + r * kCols + c0 + i * 8);
  for (int k = 0; k < kb; ++k) {
    if (pf_left > 0 && ++tick >= every) {
      tick = 0;
      _mm_prefetch(pf, _MM_HINT_T0);
      pf += 64;
      --pf_left;
    }
    const uint16_t* row = blk + (size_t)k * kCols + c0;
    __m256 b[V];
#pragma GCC unroll 4
    for (int i = 0; i < V; ++i) b[i] = widen(row + 8 * i);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_set1_ps(a[r * 2048 + k]);
#pragma GCC unroll 4
      for (int i = 0; i < V; ++i) s[r][i] = _mm256_fmadd_ps(av, b[i], s[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < V; ++i) _mm256_storeu_ps(sums + r * kCols + c0 + i * 8, s[r][i]);
}
int main(int argc, char** argv) {
  const int kb = atoi(argv[1]), every = atoi(argv[2]), mode = argc > 3 ? atoi(argv[3]) : 0;
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
          const char* pf = reinterpret_cast<const char*>(blk + (size_t)kb * kCols);
          int pf_left = l1 ? 0 : kb * kRowBytes / 64;
          int tick = 0;
          if (mode == 0) {  // 4 + 4, interleaved per panel of 24
            for (int c0 = 0; c0 < kCols; c0 += 24) {
              panel<4, 3>(c0, blk, kb, a.data(), sums.data(), pf, pf_left, every, tick);
              panel<4, 3>(c0, blk, kb, a.data() + 4 * 2048, sums.data() + 4 * kCols, pf, pf_left,
                          every, tick);
            }
          } else if (mode == 1) {  // 4 + 4 chunk-major
            for (int c0 = 0; c0 < kCols; c0 += 24)
              panel<4, 3>(c0, blk, kb, a.data(), sums.data(), pf, pf_left, every, tick);
            for (int c0 = 0; c0 < kCols; c0 += 24)
              panel<4, 3>(c0, blk, kb, a.data() + 4 * 2048, sums.data() + 4 * kCols, pf, pf_left,
                          every, tick);
          } else {  // 8 x 1
            for (int c0 = 0; c0 < kCols; c0 += 8)
              panel<8, 1>(c0, blk, kb, a.data(), sums.data(), pf, pf_left, every, tick);
          }
        }
        if (sums[3] == 12345) std::printf(" ");
      }
      double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (ms < best[l1]) best[l1] = ms;
    }
  const double bytes = double(rows_total) * kRowBytes, flops = 2.0 * 8 * rows_total * kCols;
  std::printf(
      "mode %d kb %d every %d: mem %.1f ms (%.1f GB/s, %.0f GF) | l1-ish %.1f ms (%.0f GF)\n", mode,
      kb, every, best[0], bytes / best[0] / 1e6, flops / best[0] / 1e6, best[1],
      flops / best[1] / 1e6);
}
