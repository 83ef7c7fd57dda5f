// Two shapes alternating call by call in one process: GFLOP/s of each. Args: reps then
// (K n E R dtype) twice.
#include <immintrin.h>
#include <moekit/ragged_dot.h>
#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>
constexpr int P = 32;
// Today's widened kernel: V vectors of pairs widened once a step, R rows.
template <int R, int V>
__attribute__((noinline)) void wide(const uint16_t* a, long lda, long kc, const uint32_t* panel,
                                    float* sums) {
  __m256 s[R][V];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) s[r][v] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(0xffff0000u);
  for (long kp = 0; kp < kc / 2; ++kp) {
    const uint32_t* row = panel + kp * P;
    __m256 e[V], o[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      __m256i x = _mm256_loadu_si256((const __m256i*)(row + 8 * v));
      e[v] = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
      o[v] = _mm256_castsi256_ps(_mm256_and_si256(x, high));
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t w;
      std::memcpy(&w, a + r * lda + 2 * kp, 4);
      __m256i x = _mm256_set1_epi32(w);
      __m256 a0 = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
      __m256 a1 = _mm256_castsi256_ps(_mm256_and_si256(x, high));
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        s[r][v] = _mm256_fmadd_ps(a0, e[v], s[r][v]);
        s[r][v] = _mm256_fmadd_ps(a1, o[v], s[r][v]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(sums + r * P + 8 * v, s[r][v]);
}
struct Ahead {
  const char* p = nullptr;
  int64_t lines = 0;
  int shift = 0;
};
inline void prefetch_step(const Ahead& ahead, int64_t step) {
  const int64_t line = step >> ahead.shift;
  if (line < ahead.lines && line << ahead.shift == step) {
    __builtin_prefetch(ahead.p + 64 * line, 0, 2);
  }
}
template <int R, int V>
__attribute__((noinline)) void wide2(const uint16_t* a, long lda, long kc, const uint32_t* panel,
                                     float* sums, Ahead ahead) {
  __m256 s[R][V];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) s[r][v] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(0xffff0000u);
  for (long kp = 0; kp < (kc + 1) / 2; ++kp) {
    prefetch_step(ahead, kp);
    const bool last_odd = 2 * kp + 1 == kc;
    const uint32_t* row = panel + kp * P;
    __m256 e[V], o[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      __m256i x = _mm256_loadu_si256((const __m256i*)(row + 8 * v));
      e[v] = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
      o[v] = _mm256_castsi256_ps(_mm256_and_si256(x, high));
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      uint32_t w = a[r * lda + 2 * kp];
      if (!last_odd) std::memcpy(&w, a + r * lda + 2 * kp, 4);
      __m256i x = _mm256_set1_epi32(w);
      __m256 a0 = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
      __m256 a1 = _mm256_castsi256_ps(_mm256_and_si256(x, high));
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        s[r][v] = _mm256_fmadd_ps(a0, e[v], s[r][v]);
        s[r][v] = _mm256_fmadd_ps(a1, o[v], s[r][v]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(sums + r * P + 8 * v, s[r][v]);
}
using namespace moekit;
struct Setup {
  int64_t K, n, E, R;
  bool bf16;
  std::vector<char> pk, a;
  std::vector<float> out;
  std::vector<int32_t> sizes;
  std::vector<double> t;
  long faults = 0;
  Setup(char** argv)
      : K(atoll(argv[0])),
        n(atoll(argv[1])),
        E(atoll(argv[2])),
        R(atoll(argv[3])),
        bf16(argv[4][0] == 'b') {
    const DType dt = bf16 ? DType::kBF16 : DType::kF32;
    auto ps = packed_rhs_shape(E, K, n, dt);
    size_t es = bf16 ? 2 : 4;
    pk.assign(ps.dims[0] * ps.dims[1] * ps.dims[2] * es, 0);
    for (size_t i = 0; i < pk.size(); i += 2) {
      pk[i] = (char)(i * 7 % 13);
      if (getenv("NORMAL")) pk[i + 1] = 0x3f;
    }
    a.assign(E * R * K * es, 0);
    for (size_t i = 0; i < a.size(); i += 2) {
      a[i] = (char)(i % 11);
      if (getenv("NORMAL")) a[i + 1] = 0x3f;
    }
    out.assign(E * R * n, 0.f);
    sizes.assign(E, R);
  }
  void run() {
    const DType dt = bf16 ? DType::kBF16 : DType::kF32;
    auto ps = packed_rhs_shape(E, K, n, dt);
    TensorView pv(pk.data(), dt, {ps.dims[0], ps.dims[1], ps.dims[2]});
    ConstTensorView av(a.data(), dt, {E * R, K});
    TensorView ov(out.data(), DType::kF32, {E * R, n});
    RaggedDotOptions o;
    o.rhs_packed = true;
    rusage u0, u1;
    getrusage(RUSAGE_SELF, &u0);
    auto t0 = std::chrono::steady_clock::now();
    auto s = ragged_dot(av, pv, sizes, ov, o);
    getrusage(RUSAGE_SELF, &u1);
    faults += u1.ru_minflt - u0.ru_minflt;
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    if (!s.ok()) exit(1);
  }
  void report() {
    std::sort(t.begin(), t.end());
    const double med = t[t.size() / 2], flops = 2.0 * E * R * K * n;
    printf("  percentiles 0/10/25/50/75/90: %.3f %.3f %.3f %.3f %.3f %.3f ms\n", t[0] * 1e3,
           t[t.size() / 10] * 1e3, t[t.size() / 4] * 1e3, med * 1e3, t[t.size() * 3 / 4] * 1e3,
           t[t.size() * 9 / 10] * 1e3);
    printf(
        "K %lld n %lld E %lld R %lld %s: %8.3f ms %5.1f GFLOP/s (best %5.1f) %.1f faults a call\n",
        (long long)K, (long long)n, (long long)E, (long long)R, bf16 ? "bf16" : "f32", med * 1e3,
        flops / med * 1e-9, flops / t[0] * 1e-9, (double)faults / t.size());
  }
};
int main(int argc, char** argv) {
  const int reps = atoi(argv[1]);
  Setup x(argv + 2), y(argv + 7);
  std::vector<double> kt;
  alignas(64) static float sums[64 * 32];
  for (int i = 0; i < reps; ++i) {
    x.run(), y.run();
    if (getenv("NOKERN")) continue;
    // The kernel alone on x's data: every panel of every group, halves of 4-row chunks.
    auto t0 = std::chrono::steady_clock::now();
    const int64_t words = x.K / 2 * 32, panels = x.n / 32;
    for (int64_t e = 0; e < x.E; ++e)
      for (int64_t p = 0; p < panels; ++p) {
        const uint32_t* pan =
            reinterpret_cast<const uint32_t*>(x.pk.data()) + (e * panels + p) * words;
        for (int h = 0; h < 2; ++h)
          for (int64_t r0 = 0; r0 < x.R; r0 += 4)
            wide<4, 2>(reinterpret_cast<const uint16_t*>(x.a.data()) + (e * x.R + r0) * x.K, x.K,
                       x.K, pan + 16 * h, sums);
      }
    kt.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::vector<double> kt2;
  for (int i = 0; i < (getenv("NOKERN") ? 0 : reps); ++i) {
    auto t0 = std::chrono::steady_clock::now();
    const int64_t words = x.K / 2 * 32, panels = x.n / 32;
    for (int64_t e = 0; e < x.E; ++e)
      for (int64_t p = 0; p < panels; ++p) {
        const uint32_t* pan =
            reinterpret_cast<const uint32_t*>(x.pk.data()) + (e * panels + p) * words;
        for (int h = 0; h < 2; ++h)
          for (int64_t r0 = 0; r0 < x.R; r0 += 4)
            wide2<4, 2>(reinterpret_cast<const uint16_t*>(x.a.data()) + (e * x.R + r0) * x.K, x.K,
                        x.K, pan + 16 * h, sums, Ahead{});
      }
    kt2.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    x.run();
    y.run();
  }
  if (!kt2.empty()) {
    std::sort(kt2.begin(), kt2.end());
    const double flops = 2.0 * x.E * x.R * x.K * x.n;
    printf(
        "kernel alone with the prefetch test and last_odd: %8.3f ms %5.1f GFLOP/s (best %5.1f)\n",
        kt2[kt2.size() / 2] * 1e3, flops / kt2[kt2.size() / 2] * 1e-9, flops / kt2[0] * 1e-9);
  }
  x.report();
  y.report();
  std::sort(kt.begin(), kt.end());
  const double flops = 2.0 * x.E * x.R * x.K * x.n;
  if (!kt.empty())
    printf(
        "kernel alone on x (halves 4x16, no prefetch, no stores): %8.3f ms %5.1f GFLOP/s (best "
        "%5.1f)\n",
        kt[kt.size() / 2] * 1e3, flops / kt[kt.size() / 2] * 1e-9, flops / kt[0] * 1e-9);
}
