// AVX2: R rows (f32, even/odd order, L1) against weight rows of a super-block (bf16), C at a time,
// kc = 768, sums reduced per call: the super-block in L1 (8 rows) or L2 (84 rows, 126 KiB).
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>
static inline __m256 even(__m256i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)); }
static inline __m256 odd(__m256i x) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(x, 16), 16));
}
template <int R, int C>
__attribute__((noinline)) void call(const float* a, int64_t lda, const uint16_t* b, int64_t ldb,
                                    int64_t kc, float* out) {
  __m256 s[R][C];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) s[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; k += 16) {
    __m256 be[C], bo[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m256i x = _mm256_loadu_si256((const __m256i*)(b + c * ldb + k));
      be[c] = even(x), bo[c] = odd(x);
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        s[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(a + r * lda + k), be[c], s[r][c]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        s[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(a + r * lda + k + 8), bo[c], s[r][c]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(s[r][c]), _mm256_extractf128_ps(s[r][c], 1));
      h = _mm_hadd_ps(h, h);
      h = _mm_hadd_ps(h, h);
      out[r * 64 + c] = _mm_cvtss_f32(h);
    }
}
template <int R, int C>
void time_it(int64_t sb) {
  const int64_t kc = 768;
  static std::vector<float> a(16 * kc, 1.f);
  static std::vector<uint16_t> b(256 * kc, 0x3f80);
  static float out[16 * 64];
  const int64_t reps = 4000 / sb * 8;
  auto run = [&](int64_t n) {
    for (int64_t rep = 0; rep < n; ++rep)
      for (int64_t c0 = 0; c0 < sb; c0 += C)
        call<R, C>(a.data(), kc, b.data() + c0 * kc, kc, kc, out);
  };
  run(10);
  auto t0 = std::chrono::steady_clock::now();
  run(reps);
  double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  printf("R %d x C %d, super-block %3ld rows: %6.1f GFLOP/s one core\n", R, C, (long)sb,
         2.0 * kc * R * sb * reps / sec / 1e9);
}
int main() {
  for (int i = 0; i < 2; ++i) {
    time_it<5, 2>(8);
    time_it<5, 2>(84);
    time_it<5, 2>(168);
    time_it<4, 2>(84);
    time_it<2, 4>(84);
    time_it<3, 4>(84);
    time_it<4, 3>(84);
    time_it<10, 1>(84);
    time_it<6, 2>(84);
  }
}
