// By hand: the small-batch forward's weight stream (one row a group,
// qwen3-30b-a3b's forward: 128 groups of [K 2048, n 768] bf16), each thread's
// groups read as S streams side by side: its groups split into S sets, one
// block of 16 weight rows (24 KiB) of each set's current group in turn, each
// block panel by panel (64 columns: 4 f32 sums), the sums in the group's output
// row (L1). Beside it, in the same loop, a plain read of the other copy as 4
// streams a thread.
//   ms S [S ...]
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

constexpr int64_t K = 2048, N = 768, G = 128, kBlock = 16;
volatile float sink;
volatile uint64_t isink;

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// out[0, N) += sum over the block's rows k of x[k] * w[k][0, N). VARIANT: 0 loads alone, 1 f32
// widen + FMA, 2 pairs (vpermt2w interleave + vdpbf16ps), 3 pairs without the interleave (wrong
// sums: its cost alone), 4 pairs with the block's panel pairs interleaved into L1 first
int VARIANT = 2, PF = 0;
__attribute__((target("avx512f,avx512bw,avx512bf16"))) static void block(const uint16_t* w,
                                                                         const float* x,
                                                                         float* out) {
  alignas(64) static const uint16_t lo_idx[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                  37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                  11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(lo_idx);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const int v = VARIANT;
  const int64_t lines = kBlock * N * 2 / 64, per = lines / (N / 64);
  for (int64_t c = 0; c < N; c += 64) {
    if (PF) {
      const char* nb = reinterpret_cast<const char*>(w + kBlock * N) + c / 64 * per * 64;
      for (int64_t l = 0; l < per; ++l) _mm_prefetch(nb + 64 * l, _MM_HINT_T0);
    }
    __m512 s0 = _mm512_loadu_ps(out + c), s1 = _mm512_loadu_ps(out + c + 16),
           s2 = _mm512_loadu_ps(out + c + 32), s3 = _mm512_loadu_ps(out + c + 48);
    if (v <= 1 || v >= 6) {
      for (int64_t k = 0; k < kBlock; ++k) {
        const uint16_t* r = w + k * N + c;
        const __m512 xk = _mm512_set1_ps(x[k]);
        auto wide = [](const uint16_t* p) {
          return _mm512_castsi512_ps(
              _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
        };
        if (v == 9) {  // V 8 on 256-bit vectors
          const __m256i m = _mm256_set1_epi32(int(0xffff0000u));
          const __m256 x8 = _mm256_set1_ps(x[k]);
          __m256 t[8];
          for (int q = 0; q < 4; ++q) {
            const __m256i a = _mm256_loadu_si256((const __m256i*)(r + 16 * q));
            t[2 * q] = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
            t[2 * q + 1] = _mm256_castsi256_ps(_mm256_and_si256(a, m));
          }
          __m256 lo0 = _mm512_castps512_ps256(s0),
                 hi0 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s0), 1));
          __m256 lo1 = _mm512_castps512_ps256(s1),
                 hi1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s1), 1));
          __m256 lo2 = _mm512_castps512_ps256(s2),
                 hi2 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s2), 1));
          __m256 lo3 = _mm512_castps512_ps256(s3),
                 hi3 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s3), 1));
          lo0 = _mm256_fmadd_ps(x8, t[0], lo0);
          hi0 = _mm256_fmadd_ps(x8, t[1], hi0);
          lo1 = _mm256_fmadd_ps(x8, t[2], lo1);
          hi1 = _mm256_fmadd_ps(x8, t[3], hi1);
          lo2 = _mm256_fmadd_ps(x8, t[4], lo2);
          hi2 = _mm256_fmadd_ps(x8, t[5], hi2);
          lo3 = _mm256_fmadd_ps(x8, t[6], lo3);
          hi3 = _mm256_fmadd_ps(x8, t[7], hi3);
          s0 = _mm512_insertf32x8(_mm512_castps256_ps512(lo0), hi0, 1);
          s1 = _mm512_insertf32x8(_mm512_castps256_ps512(lo1), hi1, 1);
          s2 = _mm512_insertf32x8(_mm512_castps256_ps512(lo2), hi2, 1);
          s3 = _mm512_insertf32x8(_mm512_castps256_ps512(lo3), hi3, 1);
        } else if (v == 8) {  // even / odd columns as f32 (shift, mask), FMA: exact, no interleave
          const __m512i a = _mm512_loadu_si512((const void*)r),
                        b = _mm512_loadu_si512((const void*)(r + 32));
          const __m512i m = _mm512_set1_epi32(int(0xffff0000u));
          s0 = _mm512_fmadd_ps(xk, _mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), s0);
          s1 = _mm512_fmadd_ps(xk, _mm512_castsi512_ps(_mm512_and_si512(a, m)), s1);
          s2 = _mm512_fmadd_ps(xk, _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), s2);
          s3 = _mm512_fmadd_ps(xk, _mm512_castsi512_ps(_mm512_and_si512(b, m)), s3);
        } else if (v == 6) {
          s0 = _mm512_add_ps(s0, _mm512_castsi512_ps(_mm512_loadu_si512((const void*)r)));
          s1 = _mm512_add_ps(s1, _mm512_castsi512_ps(_mm512_loadu_si512((const void*)(r + 32))));
        } else if (v == 7) {
          s0 = _mm512_fmadd_ps(xk, _mm512_castsi512_ps(_mm512_loadu_si512((const void*)r)), s0);
          s1 = _mm512_fmadd_ps(xk, _mm512_castsi512_ps(_mm512_loadu_si512((const void*)(r + 32))),
                               s1);
        } else if (v == 0) {
          s0 = _mm512_castsi512_ps(
              _mm512_add_epi32(_mm512_castps_si512(s0), _mm512_loadu_si512((const void*)r)));
          s1 = _mm512_castsi512_ps(
              _mm512_add_epi32(_mm512_castps_si512(s1), _mm512_loadu_si512((const void*)(r + 32))));
        } else {
          s0 = _mm512_fmadd_ps(xk, wide(r), s0);
          s1 = _mm512_fmadd_ps(xk, wide(r + 16), s1);
          s2 = _mm512_fmadd_ps(xk, wide(r + 32), s2);
          s3 = _mm512_fmadd_ps(xk, wide(r + 48), s3);
        }
      }
    } else {
      for (int64_t k = 0; k < kBlock; k += 2) {
        const uint16_t* r = w + k * N + c;
        const __m512i a0 = _mm512_loadu_si512(r), a1 = _mm512_loadu_si512(r + 32);
        const __m512i b0 = _mm512_loadu_si512(r + N), b1 = _mm512_loadu_si512(r + N + 32);
        uint32_t xp;
        {
          const uint16_t hx = 0x3f00;
          xp = hx | (uint32_t(hx) << 16);
        }
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(int(xp + (uint32_t)x[k]));
        if (v == 2) {
          s0 = _mm512_dpbf16_ps(s0, (__m512bh)_mm512_permutex2var_epi16(a0, lo, b0), xb);
          s1 = _mm512_dpbf16_ps(s1, (__m512bh)_mm512_permutex2var_epi16(a0, hi, b0), xb);
          s2 = _mm512_dpbf16_ps(s2, (__m512bh)_mm512_permutex2var_epi16(a1, lo, b1), xb);
          s3 = _mm512_dpbf16_ps(s3, (__m512bh)_mm512_permutex2var_epi16(a1, hi, b1), xb);
        } else {
          s0 = _mm512_dpbf16_ps(s0, (__m512bh)a0, xb);
          s1 = _mm512_dpbf16_ps(s1, (__m512bh)b0, xb);
          s2 = _mm512_dpbf16_ps(s2, (__m512bh)a1, xb);
          s3 = _mm512_dpbf16_ps(s3, (__m512bh)b1, xb);
        }
      }
    }
    _mm512_storeu_ps(out + c, s0);
    _mm512_storeu_ps(out + c + 16, s1);
    _mm512_storeu_ps(out + c + 32, s2);
    _mm512_storeu_ps(out + c + 48, s3);
  }
}

static void forward(const uint16_t* w, const float* x, float* out, int S) {
#pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t g0 = G * t / n, g1 = G * (t + 1) / n, mine = g1 - g0;
    // Set s: groups [g0 + mine * s / S, g0 + mine * (s + 1) / S), each read
    // block by block.
    std::vector<int64_t> g(S), end(S), b(S, 0);
    for (int s = 0; s < S; ++s) g[s] = g0 + mine * s / S, end[s] = g0 + mine * (s + 1) / S;
    const int64_t blocks = K / kBlock;
    for (bool busy = true; busy;) {
      busy = false;
      for (int s = 0; s < S; ++s) {
        if (g[s] >= end[s]) continue;
        busy = true;
        block(w + g[s] * K * N + b[s] * kBlock * N, x + g[s] * K + b[s] * kBlock, out + g[s] * N);
        if (++b[s] == blocks) b[s] = 0, ++g[s];
      }
    }
  }
}

static void read4(const uint64_t* w, size_t words) {
  uint64_t total = 0;
#pragma omp parallel reduction(+ : total)
  {
    const size_t n = omp_get_num_threads(), i = omp_get_thread_num();
    const size_t begin = words * i / n, end = words * (i + 1) / n, part = (end - begin) / 32 * 8;
    uint64_t sum[8] = {};
    for (size_t j = 0; j < part; j += 8)
      for (size_t s = 0; s < 4; ++s)
        for (size_t u = 0; u < 8; ++u) sum[u] += w[begin + s * part + j + u];
    for (auto v : sum) total += v;
  }
  isink = total;
}

int main(int argc, char** argv) {
  const size_t bytes = size_t(G) * K * N * 2;
  std::vector<uint16_t*> w(2);
  for (auto& p : w) {
    p = static_cast<uint16_t*>(std::aligned_alloc(4096, bytes));
    for (size_t i = 0; i < bytes / 2; ++i) p[i] = 0x3c00 + (i & 7);
  }
  VARIANT = atoi(argv[1]);
  PF = getenv("PF") ? atoi(getenv("PF")) : 0;
  std::vector<float> x(G * K, 0.5f), out(G * N);
  for (int round = 0; round < 2; ++round) {
    for (int a = 2; a < argc; ++a) {
      const int S = atoi(argv[a]);
      std::vector<double> tf, tr;
      for (int rep = 0; rep < 7; ++rep) {
        std::fill(out.begin(), out.end(), 0.f);
        double t0 = now();
        forward(w[rep % 2], x.data(), out.data(), S);
        tf.push_back(now() - t0);
        t0 = now();
        read4(reinterpret_cast<const uint64_t*>(w[(rep + 1) % 2]), bytes / 8);
        tr.push_back(now() - t0);
      }
      std::sort(tf.begin(), tf.end());
      std::sort(tr.begin(), tr.end());
      sink = out[5];
      std::printf(
          "PF=%d V=%d round %d S=%d: forward %.1f GB/s, 4-stream read %.1f GB/s: "
          "%.0f%% of it\n",
          PF, VARIANT, round, S, bytes / tf[3] / 1e9, bytes / tr[3] / 1e9, 100 * tr[3] / tf[3]);
    }
  }
}
