// Compute rate of an axpy-form bf16 pair kernel with R rows x 1 vector (16 columns) of sums: each
// step interleaves 16 columns of two weight rows into 16 pairs (zero-extend + shift + or) and runs
// R vdpbf16ps with the rows' pairs broadcast from memory. L1-resident data, one thread per core.
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>

template <int R, int V>
__attribute__((noinline, target("avx512f,avx512bw,avx512bf16"))) float run(
    const uint16_t* a, int lda, const uint16_t* w, int ldw, int kp_n, int reps) {
  __m512 s[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) s[r][v] = _mm512_setzero_ps();
  for (int rep = 0; rep < reps; ++rep) {
    for (int kp = 0; kp < kp_n; ++kp) {
      __m512i p[V];
      for (int v = 0; v < V; ++v) {
        const __m512i x =
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(w + 2 * kp * ldw + 16 * v)));
        const __m512i y = _mm512_cvtepu16_epi32(
            _mm256_loadu_si256((const __m256i*)(w + (2 * kp + 1) * ldw + 16 * v)));
        p[v] = _mm512_or_si512(x, _mm512_slli_epi32(y, 16));
      }
#pragma GCC unroll 32
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, a + r * lda + 2 * kp, 4);
        const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
        for (int v = 0; v < V; ++v) s[r][v] = _mm512_dpbf16_ps(s[r][v], av, (__m512bh)p[v]);
      }
    }
  }
  __m512 t = _mm512_setzero_ps();
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) t = _mm512_add_ps(t, s[r][v]);
  return _mm512_reduce_add_ps(t);
}

template <int R, int V>
void bench() {
  const int K = 128, kp_n = K / 2, reps = 200000;
  alignas(64) static uint16_t a[32 * 256], w[256 * 64];
  for (auto& x : a) x = 0x3f80;
  for (auto& x : w) x = 0x3f80;
  double best = 0;
  for (int t = 0; t < 3; ++t) {
    auto t0 = std::chrono::steady_clock::now();
    float keep = 0;
#pragma omp parallel reduction(+ : keep)
    keep += run<R, V>(a, 256, w, 64, kp_n, reps);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double flops = 2.0 * omp_get_max_threads() * reps * kp_n * R * 16 * V * 2;
    if (flops / s > best) best = flops / s;
    if (keep == 1) printf(" ");
  }
  printf("R %2d x V %d: %.0f GFLOP/s (2 threads)\n", R, V, best / 1e9);
}

int main() {
  bench<8, 1>();
  bench<12, 1>();
  bench<16, 1>();
  bench<20, 1>();
  bench<24, 1>();
  bench<8, 2>();
  bench<11, 2>();
  bench<6, 4>();
  bench<5, 4>();
}
