// Block microbench: one block of kc weight rows x n cols (ldb = n), rows split in chunks of <=6,
// chunk 0 interleaves (variant), others read the panel.
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#define AT __attribute__((target("avx512f,avx512bw,avx512bf16")))
constexpr int kPanel = 64;
bool getenv_seq = false;
bool getenv_strip = false;
int W1 = 11;
const char* g_pf = nullptr;
int g_pfn = 0;
int g_loc = 3;
bool g_nostore = false, g_noshuf = false;
const char* g_strip = nullptr;
int64_t g_strip_row = 0, g_strip_rows = 0, g_strip_ld = 0;
inline void stripstep() {
  if (g_strip_row < g_strip_rows) {
    __builtin_prefetch(g_strip + g_strip_row * g_strip_ld);
    __builtin_prefetch(g_strip + g_strip_row * g_strip_ld + 64);
    ++g_strip_row;
  }
}
AT inline void pfstep() {
  for (int i = 0; i < g_pfn; ++i) {
    if (g_loc == 3)
      __builtin_prefetch(g_pf, 0, 3);
    else if (g_loc == 2)
      __builtin_prefetch(g_pf, 0, 2);
    else
      __builtin_prefetch(g_pf, 0, 1);
    g_pf += 64;
  }
}
AT inline __m512bh pair_at(const uint16_t* a) {
  int32_t w;
  memcpy(&w, a, 4);
  return (__m512bh)_mm512_set1_epi32(w);
}

// variant 0: as in the library (all 4 vectors interleaved, then R rows x 4)
template <int R, int kFrom>  // 0 source-store, 1 panel, 2 source-store by halves
AT __attribute__((noinline)) void axpy(const uint16_t* a, int64_t lda, int64_t kc,
                                       const uint16_t* b, int64_t ldb, float* acc, int64_t ld_acc,
                                       uint32_t* panel) {
  __m512 s[R][4];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) s[r][i] = _mm512_loadu_ps(acc + r * ld_acc + 16 * i);
  const int64_t pairs = kc / 2;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    pfstep();
    if constexpr (kFrom == 2) {
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const uint16_t* r0 = b + 2 * kp * ldb + 32 * h;
        __m512i x = _mm512_loadu_si512(r0), y = _mm512_loadu_si512(r0 + ldb);
        __m512i v0 = _mm512_unpacklo_epi16(x, y), v1 = _mm512_unpackhi_epi16(x, y);
        _mm512_store_si512(panel + kp * kPanel + 32 * h, v0);
        _mm512_store_si512(panel + kp * kPanel + 32 * h + 16, v1);
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
          const __m512bh av = pair_at(a + r * lda + 2 * kp);
          s[r][2 * h] = _mm512_dpbf16_ps(s[r][2 * h], av, (__m512bh)v0);
          s[r][2 * h + 1] = _mm512_dpbf16_ps(s[r][2 * h + 1], av, (__m512bh)v1);
        }
      }
    } else {
      __m512i v[4];
      if constexpr (kFrom == 1) {
        stripstep();
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) v[i] = _mm512_load_si512(panel + kp * kPanel + 16 * i);
      } else {
        const uint16_t* r0 = b + 2 * kp * ldb;
        if (getenv_seq) {
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
            const __m512i x = _mm512_loadu_si512(r0 + 32 * h),
                          y = _mm512_loadu_si512(r0 + ldb + 32 * h);
            v[2 * h] = _mm512_unpacklo_epi16(x, y), v[2 * h + 1] = _mm512_unpackhi_epi16(x, y);
          }
        } else {
          __m512i x[2], y[2];
          for (int h = 0; h < 2; ++h)
            x[h] = _mm512_loadu_si512(r0 + 32 * h), y[h] = _mm512_loadu_si512(r0 + ldb + 32 * h);
          if (g_noshuf) {
            v[0] = x[0], v[1] = y[0], v[2] = x[1], v[3] = y[1];
          } else
            for (int h = 0; h < 2; ++h)
              v[2 * h] = _mm512_unpacklo_epi16(x[h], y[h]),
                    v[2 * h + 1] = _mm512_unpackhi_epi16(x[h], y[h]);
        }
        if (!g_nostore)
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i) _mm512_store_si512(panel + kp * kPanel + 16 * i, v[i]);
      }
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const __m512bh av = pair_at(a + r * lda + 2 * kp);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) s[r][i] = _mm512_dpbf16_ps(s[r][i], av, (__m512bh)v[i]);
      }
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc + r * ld_acc + 16 * i, s[r][i]);
}
template <int kFrom>
void run(int rows, const uint16_t* a, int64_t lda, int64_t kc, const uint16_t* b, int64_t ldb,
         float* acc, int64_t ld, uint32_t* p) {
  switch (rows) {
    case 1:
      return axpy<1, kFrom>(a, lda, kc, b, ldb, acc, ld, p);
    case 2:
      return axpy<2, kFrom>(a, lda, kc, b, ldb, acc, ld, p);
    case 3:
      return axpy<3, kFrom>(a, lda, kc, b, ldb, acc, ld, p);
    case 4:
      return axpy<4, kFrom>(a, lda, kc, b, ldb, acc, ld, p);
    case 5:
      return axpy<5, kFrom>(a, lda, kc, b, ldb, acc, ld, p);
    case 6:
      return axpy<6, kFrom>(a, lda, kc, b, ldb, acc, ld, p);
  }
}

template <int R>
AT __attribute__((noinline)) void axpy2w(const uint16_t* a, int64_t lda, int64_t kc,
                                         const uint16_t* b, int64_t ldb, float* acc, int64_t ld_acc,
                                         uint32_t* panel) {
  __m512 s[R][2];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 2; ++i) s[r][i] = _mm512_loadu_ps(acc + r * ld_acc + 16 * i);
  const int64_t pairs = kc / 2;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    pfstep();
    const uint16_t* r0 = b + 2 * kp * ldb;
    const __m512i x = _mm512_loadu_si512(r0), y = _mm512_loadu_si512(r0 + ldb);
    const __m512i v0 = _mm512_unpacklo_epi16(x, y), v1 = _mm512_unpackhi_epi16(x, y);
    _mm512_store_si512(panel + kp * kPanel, v0);
    _mm512_store_si512(panel + kp * kPanel + 16, v1);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512bh av = pair_at(a + r * lda + 2 * kp);
      s[r][0] = _mm512_dpbf16_ps(s[r][0], av, (__m512bh)v0);
      s[r][1] = _mm512_dpbf16_ps(s[r][1], av, (__m512bh)v1);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 2; ++i) _mm512_storeu_ps(acc + r * ld_acc + 16 * i, s[r][i]);
}
static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
int main(int argc, char** argv) {
  const int rows = atoi(argv[1]), var = atoi(argv[2]), most = argc > 6 ? atoi(argv[6]) : 6;
  const int64_t kc = argc > 3 ? atoi(argv[3]) : 86, n = argc > 4 ? atoi(argv[4]) : 768,
                lda = argc > 5 ? atoi(argv[5]) : 2048;
  const int64_t K = argc > 7 ? atoi(argv[7]) : kc;
  std::vector<uint16_t> a(rows * lda, 0x3f80);
  struct B {
    uint16_t* p;
    uint16_t* data() { return p; }
  } b;
  {
    size_t bytes = (K * n * 2 + (2 << 20)) & ~size_t((2 << 20) - 1);
    b.p = (uint16_t*)aligned_alloc(2 << 20, bytes);
    if (getenv("HUGE")) madvise(b.p, bytes, MADV_HUGEPAGE);
    for (int64_t i = 0; i < K * n; ++i) b.p[i] = 0x3c00;
  }
  std::vector<float> acc(rows * n);
  uint32_t* panel = (uint32_t*)aligned_alloc(64, (kc / 2) * 64 * 4);
  getenv_seq = getenv("SEQ") != nullptr;
  getenv_strip = getenv("STRIP") != nullptr;
  g_nostore = getenv("NOSTORE");
  g_noshuf = getenv("NOSHUF");
  if (getenv("W1")) W1 = atoi(getenv("W1"));
  g_loc = getenv("LOC") ? atoi(getenv("LOC")) : 3;
  const int chunks = (rows + most - 1) / most;
  const int iters = 2e9 / (2.0 * rows * kc * n);
  double best = 1e9;
  for (int rep = 0; rep < 7; ++rep) {
    double t = now();
    for (int it = 0; it < iters; it += K / kc)
      for (int64_t k0 = 0; k0 + kc <= K; k0 += kc)
        for (int64_t c0 = 0;
             (c0 == 0
                  ? (g_pf = (const char*)(b.data() + (k0 + kc < K ? k0 + kc : 0) * n),
                    g_pfn = getenv("PF") ? (kc * n * 2 / 64 + (n / 64) * chunks * (kc / 2) - 1) /
                                               ((n / 64) * chunks * (kc / 2))
                                         : 0)
                  : 0),
                     c0 < n;
             c0 += 64)
          if (var == 5) {
            // first chunk: min(rows, W1) rows, V=2 halves writing the panel; the rest chunks of <=
            // most reading
            const int w1 = std::min(rows, W1);
            for (int h = 0; h < 2; ++h) {
              const uint16_t* bp = b.data() + k0 * n + c0 + 32 * h;
              float* sp = acc.data() + c0 + 32 * h;
              switch (w1) {
                case 11:
                  axpy2w<11>(a.data(), lda, kc, bp, n, sp, n, panel + 32 * h);
                  break;
                case 10:
                  axpy2w<10>(a.data(), lda, kc, bp, n, sp, n, panel + 32 * h);
                  break;
                case 9:
                  axpy2w<9>(a.data(), lda, kc, bp, n, sp, n, panel + 32 * h);
                  break;
                case 8:
                  axpy2w<8>(a.data(), lda, kc, bp, n, sp, n, panel + 32 * h);
                  break;
                default:
                  axpy2w<6>(a.data(), lda, kc, bp, n, sp, n, panel + 32 * h);
              }
            }
            const int rest = rows - w1, rc = (rest + most - 1) / most;
            for (int ci = 0; ci < rc; ++ci) {
              const int r0 = w1 + rest * ci / rc, r1 = w1 + rest * (ci + 1) / rc;
              run<1>(r1 - r0, a.data() + r0 * lda, lda, kc, nullptr, n, acc.data() + r0 * n + c0, n,
                     panel);
            }
          } else
            for (int ci = 0; ci < chunks; ++ci) {
              const int r0 = rows * ci / chunks, r1 = rows * (ci + 1) / chunks;
              const uint16_t* ap = a.data() + r0 * lda;
              float* sp = acc.data() + r0 * n + c0;
              if (ci == 1 && getenv_strip) {
                g_strip = (const char*)(b.data() + k0 * n + c0 + 64);
                g_strip_row = 0;
                g_strip_rows = c0 + 64 < n ? kc : 0;
                g_strip_ld = n * 2;
              }
              if (ci > 0 || var == 1)
                run<1>(r1 - r0, ap, lda, kc, b.data() + k0 * n + c0, n, sp, n, panel);
              else if (var == 0)
                run<0>(r1 - r0, ap, lda, kc, b.data() + k0 * n + c0, n, sp, n, panel);
              else
                run<2>(r1 - r0, ap, lda, kc, b.data() + k0 * n + c0, n, sp, n, panel);
            }
    t = now() - t;
    if (t < best) best = t;
  }
  printf("rows %d var %d kc %ld n %ld: %.0f GFLOP/s\n", rows, var, (long)kc, (long)n,
         2.0 * rows * kc * n * iters / best / 1e9);
}
