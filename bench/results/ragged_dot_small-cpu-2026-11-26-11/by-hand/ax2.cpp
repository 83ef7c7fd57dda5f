// AVX2 axpy kernels in L1: acc[R][V*8] += sum_k a[r][k] * w[k][0..8V), w bf16, a bf16 or f32.
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
static inline float bf(uint16_t x) {
  uint32_t u = uint32_t(x) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
// mode 0: a bf16 scalar converted each step (the library before); 1: a pre-converted f32, broadcast
// from memory; 2: as 1 with weights as even/odd halves of 16 columns (shift / and), V counts
// 16-column pairs; 3: weights constant in registers (the FMAs' peak); 4: f32 weights.
template <int R, int V, int kMode>
__attribute__((noinline)) void run(const uint16_t* a16, const float* a32, int64_t lda,
                                   const uint16_t* w, int64_t ldw, int64_t kc, float* acc,
                                   int64_t reps) {
  constexpr int NV = kMode == 2 ? 2 * V : V;
  __m256 s[R][NV];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) s[r][i] = _mm256_loadu_ps(acc + r * 64 + 8 * i);
  for (int64_t rep = 0; rep < reps; ++rep) {
    for (int64_t k = 0; k < kc; ++k) {
      const uint16_t* row = w + k * ldw;
      __m256 bv[NV];
      if constexpr (kMode == 3) {
#pragma GCC unroll 8
        for (int i = 0; i < NV; ++i) bv[i] = _mm256_set1_ps(1.0f + i);
      } else if constexpr (kMode == 4) {
#pragma GCC unroll 8
        for (int i = 0; i < NV; ++i) bv[i] = _mm256_load_ps((const float*)row + 8 * i);
      } else if constexpr (kMode == 2) {
#pragma GCC unroll 4
        for (int i = 0; i < V; ++i) {
          const __m256i x = _mm256_load_si256((const __m256i*)(row + 16 * i));
          bv[2 * i] = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
          bv[2 * i + 1] = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(0xffff0000)));
        }
      } else {
#pragma GCC unroll 4
        for (int i = 0; i < V; ++i)
          bv[i] = _mm256_castsi256_ps(_mm256_slli_epi32(
              _mm256_cvtepu16_epi32(_mm_load_si128((const __m128i*)(row + 8 * i))), 16));
      }
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        __m256 av;
        if constexpr (kMode == 0)
          av = _mm256_set1_ps(bf(a16[r * lda + k]));
        else
          av = _mm256_broadcast_ss(a32 + r * lda + k);
#pragma GCC unroll 8
        for (int i = 0; i < NV; ++i) s[r][i] = _mm256_fmadd_ps(av, bv[i], s[r][i]);
      }
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + r * 64 + 8 * i, s[r][i]);
}
template <int R, int V, int kMode>
double time_it() {
  alignas(64) static uint16_t a16[16 * 256], w[256 * 64];
  alignas(64) static float a32[16 * 256], acc[16 * 64];
  for (int i = 0; i < 16 * 256; ++i) a16[i] = 0x3f80, a32[i] = 1.f;
  for (int i = 0; i < 256 * 64; ++i) w[i] = 0x3f80;
  constexpr int NV = kMode == 2 ? 2 * V : V;
  const int64_t kc = 128, reps = 400000 / (R * NV);
  run<R, V, kMode>(a16, a32, 256, w, 64, kc, acc, 100);
  auto t0 = std::chrono::steady_clock::now();
  run<R, V, kMode>(a16, a32, 256, w, 64, kc, acc, reps);
  double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double flops = 2.0 * kc * reps * R * NV * 8;
  printf("mode %d R %2d x %2d vectors: %6.1f GFLOP/s one core\n", kMode, R, NV, flops / sec / 1e9);
  return flops / sec / 1e9;
}
int main() {
  for (int round = 0; round < 2; ++round) {
    // the peak: weights in registers (mode 3) or f32 weights read by the FMAs (mode 4)
    time_it<4, 3, 3>();
    time_it<6, 2, 3>();
    time_it<3, 4, 4>();
    time_it<6, 2, 4>();
    // the library's kernel before (mode 0), A in f32 (mode 1), weights split even/odd (mode 2)
    time_it<1, 4, 0>();
    time_it<2, 4, 0>();
    time_it<3, 4, 0>();
    time_it<6, 2, 0>();
    time_it<4, 3, 0>();
    time_it<1, 4, 1>();
    time_it<2, 4, 1>();
    time_it<3, 4, 1>();
    time_it<3, 2, 1>();
    time_it<4, 2, 1>();
    time_it<5, 2, 1>();
    time_it<6, 2, 1>();
    time_it<4, 3, 1>();
    time_it<7, 2, 1>();
    time_it<3, 2, 2>();
    time_it<6, 1, 2>();
    time_it<2, 2, 2>();
    time_it<5, 1, 2>();
    time_it<7, 1, 2>();
    puts("");
  }
}
