// Prototype: one chunk of R rows on bf16 weights packed panel-major, pairs interleaved
// (P[e][panel][kp][16V columns][2]): each panel a contiguous run over the whole contraction, the
// sums in registers from the first pair to the last. Cold weights, two threads, against a read of
// the same buffer.   packed E K n R V reps
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#define T512 __attribute__((target("avx512f,avx512bw,avx512bf16")))
static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
static int64_t g_dist = 0;
static bool g_split = false;
template <int R, int V>
T512 void panel_kernel(const int32_t* a, int64_t lda_pairs, int64_t kp_count, const __m512i* w,
                       float* out, int64_t ldo) {
  __m512 s[R][V];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < V; ++i) s[r][i] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kp_count; ++kp) {
    if (g_dist > 0 && (kp * V) % 1 == 0) {
#pragma GCC unroll 4
      for (int i = 0; i < V; ++i)
        _mm_prefetch(
            (const char*)(g_split ? w + i * kp_count + kp + g_dist : w + kp * V + i + g_dist),
            _MM_HINT_T0);
    }
    __m512i v[V];
#pragma GCC unroll 4
    for (int i = 0; i < V; ++i)
      v[i] = _mm512_load_si512(g_split ? w + i * kp_count + kp : w + kp * V + i);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(a[r * lda_pairs + kp]);
#pragma GCC unroll 4
      for (int i = 0; i < V; ++i) s[r][i] = _mm512_dpbf16_ps(s[r][i], av, (__m512bh)v[i]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < V; ++i) _mm512_storeu_ps(out + r * ldo + 16 * i, s[r][i]);
}
template <int R, int V>
void run(int E, int64_t K, int64_t n, const __m512i* w, const int32_t* a, float* out, int chunks) {
  const int64_t panels = n / (16 * V), kp_count = K / 2;
  const int64_t units = (int64_t)E * panels;
#pragma omp parallel for schedule(static)
  for (int64_t u = 0; u < units; ++u) {
    const int64_t e = u / panels, p = u % panels;
    const __m512i* wp = w + (e * panels + p) * kp_count * V;
    for (int c = 0; c < chunks; ++c)
      panel_kernel<R, V>(a + (e * chunks + c) * R * kp_count, kp_count, kp_count, wp,
                         out + (e * chunks + c) * R * n + p * 16 * V, n);
  }
}
int main(int argc, char** argv) {
  const int E = atoi(argv[1]);
  const int64_t K = atoll(argv[2]), n = atoll(argv[3]);
  const int R = atoi(argv[4]), V = atoi(argv[5]), reps = argc > 6 ? atoi(argv[6]) : 5;
  const int chunks = argc > 7 ? atoi(argv[7]) : 1;
  g_split = getenv("SPLIT") != nullptr;
  g_dist = getenv("DIST") ? atoll(getenv("DIST")) : 0;
  const size_t wbytes = (size_t)E * K * n * 2;
  auto* w = static_cast<__m512i*>(aligned_alloc(64, wbytes));
  std::memset(w, 0x3c, wbytes);  // touch every page
  std::vector<int32_t> a((size_t)E * chunks * R * (K / 2), 0x3f803f80);
  std::vector<float> out((size_t)E * chunks * R * n);
  const double flops = 2.0 * E * chunks * R * K * n;
  double best_k = 1e9, best_r = 1e9;
  for (int rep = 0; rep < reps; ++rep) {
    double t = now();
    switch (R * 10 + V) {
      case 82:
        run<8, 2>(E, K, n, w, a.data(), out.data(), chunks);
        break;
      case 83:
        run<8, 3>(E, K, n, w, a.data(), out.data(), chunks);
        break;
      case 62:
        run<6, 2>(E, K, n, w, a.data(), out.data(), chunks);
        break;
      case 64:
        run<6, 4>(E, K, n, w, a.data(), out.data(), chunks);
        break;
      case 122:
        run<12, 2>(E, K, n, w, a.data(), out.data(), chunks);
        break;
      case 161:
        run<16, 1>(E, K, n, w, a.data(), out.data(), chunks);
        break;
      case 101:
        run<10, 1>(E, K, n, w, a.data(), out.data(), chunks);
        break;
      case 42:
        run<4, 2>(E, K, n, w, a.data(), out.data(), chunks);
        break;
      case 44:
        run<4, 4>(E, K, n, w, a.data(), out.data(), chunks);
        break;
      case 12:
        run<1, 2>(E, K, n, w, a.data(), out.data(), chunks);
        break;
      default:
        std::printf("no kernel R %d V %d\n", R, V);
        return 1;
    }
    best_k = std::min(best_k, now() - t);
    // the read of the same buffer, two threads
    t = now();
    const int64_t lines = wbytes / 64;
    __m512i acc = _mm512_setzero_si512();
#pragma omp parallel
    {
      __m512i x = _mm512_setzero_si512();
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t b0 = lines * t / nt, b1 = lines * (t + 1) / nt, q = (b1 - b0) / 4;
      __m512i y = x, z = x, u = x;
      for (int64_t i = 0; i < q; ++i) {
        x = _mm512_xor_si512(x, _mm512_load_si512(w + b0 + i));
        y = _mm512_xor_si512(y, _mm512_load_si512(w + b0 + q + i));
        z = _mm512_xor_si512(z, _mm512_load_si512(w + b0 + 2 * q + i));
        u = _mm512_xor_si512(u, _mm512_load_si512(w + b0 + 3 * q + i));
      }
      x = _mm512_xor_si512(_mm512_xor_si512(x, y), _mm512_xor_si512(z, u));
#pragma omp critical
      acc = _mm512_xor_si512(acc, x);
    }
    best_r = std::min(best_r, now() - t);
    volatile int sink = _mm512_reduce_add_epi32(acc);
    (void)sink;
  }
  std::printf(
      "E %d K %ld n %ld rows %d (R %d x %d) V %d: kernel %.2f ms (%.1f GFLOP/s, %.1f GB/s)  read "
      "%.2f ms (%.1f GB/s)  kernel/read %.2f\n",
      E, (long)K, (long)n, R * chunks, R, chunks, V, best_k * 1e3, flops / best_k / 1e9,
      wbytes / best_k / 1e9, best_r * 1e3, wbytes / best_r / 1e9, best_k / best_r);
}
