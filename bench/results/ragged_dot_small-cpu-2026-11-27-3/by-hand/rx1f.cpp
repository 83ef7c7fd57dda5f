// R rows x V vectors of f32 sums over bf16 weights in L1: GFLOP/s of one core.
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
static inline __m256 widen(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
constexpr int KB = 64, COLS = 64;
alignas(64) uint16_t W[KB * COLS];
alignas(64) float WF[KB * COLS];
static bool F = false;
alignas(64) float A[16 * KB];
alignas(64) float S[16 * COLS];
template <int R, int V>
__attribute__((noinline)) void run(int reps) {
  for (int rep = 0; rep < reps; ++rep)
    for (int p = 0; p < COLS / (8 * V); ++p) {
      __m256 s[R][V];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int i = 0; i < V; ++i) s[r][i] = _mm256_loadu_ps(S + r * COLS + p * 8 * V + i * 8);
      for (int k = 0; k < KB; ++k) {
        __m256 b[V];
#pragma GCC unroll 4
        for (int i = 0; i < V; ++i)
          b[i] = F ? _mm256_loadu_ps(WF + k * COLS + p * 8 * V + i * 8)
                   : widen(W + k * COLS + p * 8 * V + i * 8);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m256 av = _mm256_broadcast_ss(A + r * KB + k);
#pragma GCC unroll 4
          for (int i = 0; i < V; ++i) s[r][i] = _mm256_fmadd_ps(av, b[i], s[r][i]);
        }
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int i = 0; i < V; ++i) _mm256_storeu_ps(S + r * COLS + p * 8 * V + i * 8, s[r][i]);
    }
}
template <int R, int V>
void time_it() {
  const int reps = 200000;
  run<R, V>(100);
  auto t = std::chrono::steady_clock::now();
  run<R, V>(reps);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  std::printf("%2d x %d: %6.1f GFLOP/s\n", R, V, 2.0 * R * KB * COLS * reps / s / 1e9);
}
int main() {
  for (auto& w : W) w = 0x3f80;
  for (auto& a : A) a = 1e-3f;
  for (int f = 0; f < 2; ++f) {
    F = f;
    std::printf(f ? "f32 weights\n" : "bf16 weights\n");
    time_it<6, 2>();
    time_it<2, 4>();
    time_it<3, 4>();
    time_it<4, 2>();
    time_it<5, 2>();
  }
}
