// AVX2 dot kernels in L1: s[r][c] += sum_k a[r][k] b[c][k], b bf16.
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
static inline __m256 widen(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline __m256 even(__m256i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)); }
static inline __m256 odd(__m256i x) {
  return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(0xffff0000)));
}
// mode 0: a, b bf16 widened 8 at a time; 1: a, b bf16 as even/odd halves of 16; 2: a f32 (even/odd
// order), b bf16 even/odd halves.
template <int R, int C, int kMode>
__attribute__((noinline)) void run(const uint16_t* a16, const float* a32, int64_t lda,
                                   const uint16_t* b, int64_t ldb, int64_t kc, float* out,
                                   int64_t reps) {
  __m256 s[R][C];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) s[r][c] = _mm256_setzero_ps();
  for (int64_t rep = 0; rep < reps; ++rep) {
    if constexpr (kMode == 0) {
      for (int64_t k = 0; k < kc; k += 8) {
        __m256 bv[C];
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) bv[c] = widen(b + c * ldb + k);
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
          const __m256 av = widen(a16 + r * lda + k);
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) s[r][c] = _mm256_fmadd_ps(av, bv[c], s[r][c]);
        }
      }
    } else if constexpr (kMode == 1) {
      for (int64_t k = 0; k < kc; k += 16) {
        __m256i bx[C];
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) bx[c] = _mm256_loadu_si256((const __m256i*)(b + c * ldb + k));
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
          const __m256i ax = _mm256_loadu_si256((const __m256i*)(a16 + r * lda + k));
          const __m256 ae = even(ax), ao = odd(ax);
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) s[r][c] = _mm256_fmadd_ps(ae, even(bx[c]), s[r][c]);
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) s[r][c] = _mm256_fmadd_ps(ao, odd(bx[c]), s[r][c]);
        }
      }
    } else {
      for (int64_t k = 0; k < kc; k += 16) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          __m256 bv[C];
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) {
            const __m256i x = _mm256_loadu_si256((const __m256i*)(b + c * ldb + k));
            bv[c] = h == 0 ? even(x) : odd(x);
          }
#pragma GCC unroll 12
          for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c)
              s[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(a32 + r * lda + k + 8 * h), bv[c], s[r][c]);
          }
        }
      }
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + (r * C + c) * 8, s[r][c]);
}
template <int R, int C, int kMode>
void time_it() {
  alignas(64) static uint16_t a16[16 * 512], b[16 * 512];
  alignas(64) static float a32[16 * 512], out[16 * 64];
  for (int i = 0; i < 16 * 512; ++i) a16[i] = 0x3f80, b[i] = 0x3f80, a32[i] = 1.f;
  const int64_t kc = 512, reps = 200000 / (R * C);
  run<R, C, kMode>(a16, a32, 512, b, 512, kc, out, 100);
  auto t0 = std::chrono::steady_clock::now();
  run<R, C, kMode>(a16, a32, 512, b, 512, kc, out, reps);
  double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  printf("mode %d R %d x C %d: %6.1f GFLOP/s one core\n", kMode, R, C,
         2.0 * kc * reps * R * C / sec / 1e9);
}
int main() {
  for (int round = 0; round < 2; ++round) {
    time_it<2, 4, 0>();
    time_it<3, 4, 0>();
    time_it<6, 2, 0>();
    time_it<2, 4, 1>();
    time_it<3, 4, 1>();
    time_it<6, 2, 1>();
    time_it<4, 3, 1>();
    time_it<2, 4, 2>();
    time_it<3, 4, 2>();
    time_it<6, 2, 2>();
    time_it<4, 3, 2>();
    time_it<5, 2, 2>();
    time_it<12, 1, 2>();
    time_it<8, 1, 2>();
    puts("");
  }
}
