// By-hand AMX prototype (issue 35): the forward of a grouped matmul with few rows a group,
// weights cold. See amx.txt for the build line, the arguments and the results.
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

struct alignas(64) TileCfg {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

static void configure(int mrows0, int mrows1) {
  TileCfg c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64;
  // C tiles 0-3: (a0, b0..b3) for one A tile, or (a0,b0),(a0,b1),(a1,b0),(a1,b1)
  c.rows[4] = mrows0, c.rows[5] = mrows1 > 0 ? mrows1 : 16;
  c.rows[6] = c.rows[7] = 16;
  if (mrows1 == 0) {
    for (int t = 0; t < 4; ++t) c.rows[t] = mrows0;
  } else {
    c.rows[0] = c.rows[1] = mrows0;
    c.rows[2] = c.rows[3] = mrows1;
  }
  asm volatile("ldtilecfg %0" ::"m"(c));
}

// vnni[kp][c] = (w[2kp][c], w[2kp+1][c]) for kp < kc/2, c < n (n % 32 == 0, kc even)
__attribute__((target("avx512f,avx512bw"))) static void repack(const uint16_t* w, int64_t n, int kc,
                                                               uint32_t* vnni, const uint16_t* next,
                                                               int64_t next_bytes) {
  alignas(64) static const uint16_t lo_idx[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                  37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                  11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(lo_idx);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  (void)next;
  for (int kp = next_bytes; kp < kc / 2; ++kp) {
    const uint16_t* r0 = w + 2 * kp * n;
    const uint16_t* r1 = r0 + n;
    uint32_t* o = vnni + kp * n;
    for (int64_t c = 0; c < n; c += 32) {
      const __m512i a = _mm512_loadu_si512(r0 + c), b = _mm512_loadu_si512(r1 + c);
      _mm512_store_si512(o + c, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_store_si512(o + c + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

static int STREAMS = 4;
__attribute__((target("avx512f,avx512bw"))) static void repack4(const uint16_t* w, int64_t n,
                                                                int kc, uint32_t* vnni) {
  alignas(64) static const uint16_t lo_idx[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                  37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                  11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(lo_idx);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const int q = kc / 2 / STREAMS;
  for (int kq = 0; kq < q; ++kq) {
    for (int s = 0; s < STREAMS; ++s) {
      const int kp = s * q + kq;
      const uint16_t* r0 = w + 2 * kp * n;
      const uint16_t* r1 = r0 + n;
      uint32_t* o = vnni + kp * n;
      for (int64_t c = 0; c < n; c += 32) {
        const __m512i a = _mm512_loadu_si512(r0 + c), b = _mm512_loadu_si512(r1 + c);
        _mm512_store_si512(o + c, _mm512_permutex2var_epi16(a, lo, b));
        _mm512_store_si512(o + c + 16, _mm512_permutex2var_epi16(a, hi, b));
      }
    }
  }
}
int KC = 256, PF = 1, MODE = 0;  // MODE 0 full, 1 repack only, 2 tiles only, 3 repack in 4 streams

// acc[rows][n] (+)= x[rows][kc] (lda) * vnni[kc/2][n]
template <int MT>
__attribute__((target("amx-tile,amx-bf16"))) static void tiles(int rows, const uint16_t* x,
                                                               int64_t lda, int kc,
                                                               const uint32_t* vnni, int64_t n,
                                                               float* acc, bool first,
                                                               const char* pf, int64_t pf_lines) {
  constexpr int NT = 4 / MT;
  const int64_t ldc = n * 4;
  int64_t pf_at = 0;
  const int64_t blocks = n / (16 * NT);
  const int64_t pf_per_block = (pf_lines + blocks - 1) / std::max<int64_t>(1, blocks);
  for (int64_t cb = 0; cb < n; cb += 16 * NT) {
    float* c0 = acc + cb;
    if (first) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    } else {
      _tile_loadd(0, c0, ldc);
      _tile_loadd(1, c0 + 16, ldc);
      if (MT == 1) {
        _tile_loadd(2, c0 + 32, ldc);
        _tile_loadd(3, c0 + 48, ldc);
      } else {
        _tile_loadd(2, c0 + 16 * n, ldc);
        _tile_loadd(3, c0 + 16 * n + 16, ldc);
      }
    }
    for (int64_t i = 0; i < pf_per_block && pf_at < pf_lines; ++i, ++pf_at) {
      if (PF == 1)
        _mm_prefetch(pf + 64 * pf_at, _MM_HINT_T0);
      else if (PF == 2)
        _mm_prefetch(pf + 64 * pf_at, _MM_HINT_T1);
      else
        _mm_prefetch(pf + 64 * pf_at, _MM_HINT_T2);
    }
    for (int s = 0; s < kc / 32; ++s) {
      const uint32_t* b = vnni + 16 * s * n + cb;
      _tile_loadd(4, x + 32 * s, lda * 2);
      if (MT == 2) _tile_loadd(5, x + 16 * lda + 32 * s, lda * 2);
      _tile_loadd(6, b, n * 4);
      _tile_loadd(7, b + 16, n * 4);
      if (MT == 1) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, b + 32, n * 4);
        _tile_loadd(7, b + 48, n * 4);
        _tile_dpbf16ps(2, 4, 6);
        _tile_dpbf16ps(3, 4, 7);
      } else {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, c0, ldc);
    _tile_stored(1, c0 + 16, ldc);
    if (MT == 1) {
      _tile_stored(2, c0 + 32, ldc);
      _tile_stored(3, c0 + 48, ldc);
    } else {
      _tile_stored(2, c0 + 16 * n, ldc);
      _tile_stored(3, c0 + 16 * n + 16, ldc);
    }
  }
}

// MODE 6 / 7: rows a multiple of 32, the column blocks outermost, the row blocks inside them (the
// block's B tiles stay in L1 for the second row block).
__attribute__((target("amx-tile,amx-bf16"))) static void tiles_couter(int rows, const uint16_t* x,
                                                                      int64_t lda, int kc,
                                                                      const uint32_t* vnni,
                                                                      int64_t n, float* acc,
                                                                      bool first) {
  const int64_t ldc = n * 4;
  for (int64_t cb = 0; cb < n; cb += 32) {
    for (int r0 = 0; r0 < rows; r0 += 32) {
      float* c0 = acc + r0 * n + cb;
      const uint16_t* xr = x + r0 * lda;
      if (first) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      } else {
        _tile_loadd(0, c0, ldc);
        _tile_loadd(1, c0 + 16, ldc);
        _tile_loadd(2, c0 + 16 * n, ldc);
        _tile_loadd(3, c0 + 16 * n + 16, ldc);
      }
      for (int s = 0; s < kc / 32; ++s) {
        const uint32_t* b = vnni + 16 * s * n + cb;
        _tile_loadd(4, xr + 32 * s, lda * 2);
        _tile_loadd(5, xr + 16 * lda + 32 * s, lda * 2);
        _tile_loadd(6, b, n * 4);
        _tile_loadd(7, b + 16, n * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c0, ldc);
      _tile_stored(1, c0 + 16, ldc);
      _tile_stored(2, c0 + 16 * n, ldc);
      _tile_stored(3, c0 + 16 * n + 16, ldc);
    }
  }
}

// One group: out[rows][n] f32 = x[rows][K] * w[K][n]
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw"))) void group_fwd(
    int rows, const uint16_t* x, int64_t K, const uint16_t* w, int64_t n, float* out,
    uint32_t* vnni, const uint16_t* wnext) {
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int kc = static_cast<int>(std::min<int64_t>(KC, K - k0));
    const uint16_t* wk = w + k0 * n;
    if (MODE == 8) {
      for (int r = 0; r < rows; ++r)
        for (int l = 0; l < kc * 2; l += 64)
          _mm_prefetch(reinterpret_cast<const char*>(x + r * K + k0) + l, _MM_HINT_T0);
    }
    if (MODE == 3 || MODE == 4 || MODE == 7 || MODE == 8)
      repack4(wk, n, kc, vnni);
    else if (MODE != 2 && MODE != 6)
      repack(wk, n, kc, vnni, nullptr, 0);
    if (MODE == 1 || MODE == 4) continue;
    if (MODE == 6 || MODE == 7) {
      configure(16, 16);
      tiles_couter(rows, x + k0, K, kc, vnni, n, out, k0 == 0);
      continue;
    }
    // prefetch the next chunk (or the next group's first) while the tiles run
    const char* pf = k0 + KC < K ? reinterpret_cast<const char*>(wk + kc * n)
                                 : reinterpret_cast<const char*>(wnext);
    const int64_t pf_lines = PF && pf ? (int64_t)KC * n * 2 / 64 : 0;
    int64_t done_pf = 0;
    for (int r0 = 0; r0 < rows; r0 += 32) {
      const int rb = std::min(32, rows - r0);
      const int64_t share = r0 + 32 >= rows ? pf_lines - done_pf : pf_lines * rb / rows;
      if (rb <= 16) {
        configure(rb, 0);
        tiles<1>(rb, x + r0 * K + k0, K, kc, vnni, n, out + r0 * n, k0 == 0, pf + 64 * done_pf,
                 share);
      } else {
        configure(16, rb - 16);
        tiles<2>(rb, x + r0 * K + k0, K, kc, vnni, n, out + r0 * n, k0 == 0, pf + 64 * done_pf,
                 share);
      }
      done_pf += share;
    }
  }
}

// Pipelined: chunks (group, k0) in order; while chunk i's tiles run, chunk i+1 is repacked in
// slices after each column block.
struct Chunk {
  int rows;
  const uint16_t* x;
  const uint16_t* w;
  float* out;
  int64_t k0;
  int kc;
};

template <int MT>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw"))) static void tiles_pipe(
    int rows, const uint16_t* x, int64_t lda, int kc, const uint32_t* vnni, int64_t n, float* acc,
    bool first, const Chunk* nx, uint32_t* nvnni, int& kp_done, int units, int& unit) {
  constexpr int NT = 4 / MT;
  const int64_t ldc = n * 4;
  for (int64_t cb = 0; cb < n; cb += 16 * NT) {
    float* c0 = acc + cb;
    if (first) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    } else {
      _tile_loadd(0, c0, ldc);
      _tile_loadd(1, c0 + 16, ldc);
      if (MT == 1) {
        _tile_loadd(2, c0 + 32, ldc);
        _tile_loadd(3, c0 + 48, ldc);
      } else {
        _tile_loadd(2, c0 + 16 * n, ldc);
        _tile_loadd(3, c0 + 16 * n + 16, ldc);
      }
    }
    for (int s = 0; s < kc / 32; ++s) {
      const uint32_t* b = vnni + 16 * s * n + cb;
      _tile_loadd(4, x + 32 * s, lda * 2);
      if (MT == 2) _tile_loadd(5, x + 16 * lda + 32 * s, lda * 2);
      _tile_loadd(6, b, n * 4);
      _tile_loadd(7, b + 16, n * 4);
      if (MT == 1) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, b + 32, n * 4);
        _tile_loadd(7, b + 48, n * 4);
        _tile_dpbf16ps(2, 4, 6);
        _tile_dpbf16ps(3, 4, 7);
      } else {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, c0, ldc);
    _tile_stored(1, c0 + 16, ldc);
    if (MT == 1) {
      _tile_stored(2, c0 + 32, ldc);
      _tile_stored(3, c0 + 48, ldc);
    } else {
      _tile_stored(2, c0 + 16 * n, ldc);
      _tile_stored(3, c0 + 16 * n + 16, ldc);
    }
    ++unit;
    if (nx) {
      const int want = nx->kc / 2 * unit / units;
      if (want > kp_done) {
        repack(nx->w + nx->k0 * n, n, 2 * want, nvnni, nullptr, kp_done);
        kp_done = want;
      }
    }
  }
}

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw"))) void run_pipe(
    const std::vector<Chunk>& cs, int64_t K, int64_t n, uint32_t* v0, uint32_t* v1) {
  if (cs.empty()) return;
  repack(cs[0].w + cs[0].k0 * n, n, cs[0].kc, v0, nullptr, 0);
  for (size_t i = 0; i < cs.size(); ++i) {
    const Chunk& c = cs[i];
    const Chunk* nx = i + 1 < cs.size() ? &cs[i + 1] : nullptr;
    const int rb_count = (c.rows + 31) / 32;
    int units = 0;
    for (int r0 = 0; r0 < c.rows; r0 += 32) units += c.rows - r0 <= 16 ? n / 64 : n / 32;
    int unit = 0, kp_done = 0;
    (void)rb_count;
    for (int r0 = 0; r0 < c.rows; r0 += 32) {
      const int rb = std::min(32, c.rows - r0);
      if (rb <= 16) {
        configure(rb, 0);
        tiles_pipe<1>(rb, c.x + r0 * K + c.k0, K, c.kc, v0, n, c.out + r0 * n, c.k0 == 0, nx, v1,
                      kp_done, units, unit);
      } else {
        configure(16, rb - 16);
        tiles_pipe<2>(rb, c.x + r0 * K + c.k0, K, c.kc, v0, n, c.out + r0 * n, c.k0 == 0, nx, v1,
                      kp_done, units, unit);
      }
    }
    if (nx && kp_done < nx->kc / 2) repack(nx->w + nx->k0 * n, n, nx->kc, v1, nullptr, kp_done);
    std::swap(v0, v1);
  }
}

// MODE 5: the next chunk repacked a few 128-byte steps after every k-step of the tiles (fine
// grain), its pairs taken from 4 quarters of the chunk in turn.
struct Cursor {
  const uint16_t* w = nullptr;
  int64_t n = 0;
  uint32_t* vnni = nullptr;
  int64_t total = 0, done = 0, q = 0, cols = 0;  // steps, done, pairs a quarter, 32-col steps a row
  void start(const uint16_t* w_, int64_t n_, int kc, uint32_t* v) {
    w = w_, n = n_, vnni = v, q = kc / 2 / 4, cols = n_ / 32, total = q * 4 * cols, done = 0;
  }
  __attribute__((target("avx512f,avx512bw"), always_inline)) inline void advance(int64_t upto) {
    alignas(64) static const uint16_t lo_idx[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                    37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                    11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i lo = _mm512_load_si512(lo_idx);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    upto = std::min(upto, total);
    for (; done < upto; ++done) {
      // order: for kq, for s (quarter), for c
      const int64_t c = done % cols, rest = done / cols, s = rest % 4, kq = rest / 4;
      const int64_t kp = s * q + kq;
      const uint16_t* r0 = w + 2 * kp * n + 32 * c;
      const __m512i a = _mm512_loadu_si512(r0), b = _mm512_loadu_si512(r0 + n);
      uint32_t* o = vnni + kp * n + 32 * c;
      _mm512_store_si512(o, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_store_si512(o + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
};

template <int MT>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw"))) static void tiles_fine(
    const uint16_t* x, int64_t lda, int kc, const uint32_t* vnni, int64_t n, float* acc, bool first,
    Cursor& cur, int64_t& ks, int64_t ks_total) {
  constexpr int NT = 4 / MT;
  const int64_t ldc = n * 4;
  for (int64_t cb = 0; cb < n; cb += 16 * NT) {
    float* c0 = acc + cb;
    if (first) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    } else {
      _tile_loadd(0, c0, ldc);
      _tile_loadd(1, c0 + 16, ldc);
      if (MT == 1) {
        _tile_loadd(2, c0 + 32, ldc);
        _tile_loadd(3, c0 + 48, ldc);
      } else {
        _tile_loadd(2, c0 + 16 * n, ldc);
        _tile_loadd(3, c0 + 16 * n + 16, ldc);
      }
    }
    for (int s = 0; s < kc / 32; ++s) {
      const uint32_t* b = vnni + 16 * s * n + cb;
      _tile_loadd(4, x + 32 * s, lda * 2);
      if (MT == 2) _tile_loadd(5, x + 16 * lda + 32 * s, lda * 2);
      _tile_loadd(6, b, n * 4);
      _tile_loadd(7, b + 16, n * 4);
      if (MT == 1) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, b + 32, n * 4);
        _tile_loadd(7, b + 48, n * 4);
        _tile_dpbf16ps(2, 4, 6);
        _tile_dpbf16ps(3, 4, 7);
      } else {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      ++ks;
      cur.advance(cur.total * ks / ks_total);
    }
    _tile_stored(0, c0, ldc);
    _tile_stored(1, c0 + 16, ldc);
    if (MT == 1) {
      _tile_stored(2, c0 + 32, ldc);
      _tile_stored(3, c0 + 48, ldc);
    } else {
      _tile_stored(2, c0 + 16 * n, ldc);
      _tile_stored(3, c0 + 16 * n + 16, ldc);
    }
  }
}

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw"))) void run_fine(
    const std::vector<Chunk>& cs, int64_t K, int64_t n, uint32_t* v0, uint32_t* v1) {
  if (cs.empty()) return;
  Cursor cur;
  cur.start(cs[0].w + cs[0].k0 * n, n, cs[0].kc, v0);
  cur.advance(cur.total);
  for (size_t i = 0; i < cs.size(); ++i) {
    const Chunk& c = cs[i];
    const Chunk* nx = i + 1 < cs.size() ? &cs[i + 1] : nullptr;
    Cursor next;
    if (nx) next.start(nx->w + nx->k0 * n, n, nx->kc, v1);
    int64_t ks_total = 0;
    for (int r0 = 0; r0 < c.rows; r0 += 32)
      ks_total += (c.rows - r0 <= 16 ? n / 64 : n / 32) * (c.kc / 32);
    int64_t ks = 0;
    for (int r0 = 0; r0 < c.rows; r0 += 32) {
      const int rb = std::min(32, c.rows - r0);
      if (rb <= 16) {
        configure(rb, 0);
        tiles_fine<1>(c.x + r0 * K + c.k0, K, c.kc, v0, n, c.out + r0 * n, c.k0 == 0, next, ks,
                      ks_total);
      } else {
        configure(16, rb - 16);
        tiles_fine<2>(c.x + r0 * K + c.k0, K, c.kc, v0, n, c.out + r0 * n, c.k0 == 0, next, ks,
                      ks_total);
      }
    }
    next.advance(next.total);
    std::swap(v0, v1);
  }
}

int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) {
    perror("arch_prctl");
    return 1;
  }
  const int64_t K = 2048, n = 768, E = 128;
  const int R = argc > 1 ? atoi(argv[1]) : 16;
  KC = argc > 2 ? atoi(argv[2]) : 256;
  PF = argc > 3 ? atoi(argv[3]) : 1;
  MODE = argc > 4 ? atoi(argv[4]) : 0;
  STREAMS = argc > 5 ? atoi(argv[5]) : 4;
  const int copies = 5, reps = 6;
  const int64_t wsz = K * n;
  std::vector<uint16_t, std::allocator<uint16_t>> dummy;
  uint16_t* w = static_cast<uint16_t*>(aligned_alloc(4096, copies * E * wsz * 2));
  uint16_t* x = static_cast<uint16_t*>(aligned_alloc(64, E * R * K * 2 + 64));
  float* out = static_cast<float*>(aligned_alloc(64, E * R * n * 4));
#pragma omp parallel for
  for (int64_t i = 0; i < copies * E * wsz; ++i) w[i] = 0x3f80 + (uint16_t)((i * 7919) % 64);
  for (int64_t i = 0; i < E * R * K; ++i) x[i] = 0x3f00 + (uint16_t)((i * 31) % 64);
  // check one group against scalar
  auto bf = [](uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  };
  std::vector<double> best(2, 1e9);
  for (int rep = 0; rep < reps * copies; ++rep) {
    const int cp = rep % copies;
    const uint16_t* wc = w + cp * E * wsz;
    auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel
    {
      const int t = omp_get_thread_num(), T = omp_get_num_threads();
      static thread_local uint32_t* vnni = static_cast<uint32_t*>(aligned_alloc(64, 4096 * 1024));
      const int64_t e0 = E * t / T, e1 = E * (t + 1) / T;
      if (PF == 9 || MODE == 5) {
        static thread_local uint32_t* v1 = static_cast<uint32_t*>(aligned_alloc(64, 4096 * 1024));
        std::vector<Chunk> cs;
        for (int64_t e = e0; e < e1; ++e)
          for (int64_t k0 = 0; k0 < K; k0 += KC)
            cs.push_back({R, x + e * R * K, wc + e * wsz, out + e * R * n, k0,
                          (int)std::min<int64_t>(KC, K - k0)});
        if (MODE == 5)
          run_fine(cs, K, n, vnni, v1);
        else
          run_pipe(cs, K, n, vnni, v1);
      } else
        for (int64_t e = e0; e < e1; ++e)
          group_fwd(R, x + e * R * K, K, wc + e * wsz, n, out + e * R * n, vnni,
                    e + 1 < e1 ? wc + (e + 1) * wsz : nullptr);
    }
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    // plain read of the same copy's bytes (the next copy, to stay cold)
    const uint16_t* wr = w + ((rep + 2) % copies) * E * wsz;
    auto t1 = std::chrono::steady_clock::now();
    float s = 0;
#pragma omp parallel for reduction(+ : s)
    for (int64_t i = 0; i < E * wsz; i += 128) {
      __m512 a = _mm512_load_ps((const float*)(wr + i)),
             b = _mm512_load_ps((const float*)(wr + i + 32));
      __m512 c = _mm512_load_ps((const float*)(wr + i + 64)),
             d = _mm512_load_ps((const float*)(wr + i + 96));
      s += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d)));
    }
    const double rms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t1).count();
    if (s == 12345) printf("x");
    if (rep >= copies) best[0] = std::min(best[0], ms), best[1] = std::min(best[1], rms);
  }
  // check
  double maxerr = 0;
  for (int e : {0, 77, 127})
    for (int r = 0; r < R; r += std::max(1, R / 3))
      for (int c = 0; c < n; c += 37) {
        double ref = 0;
        for (int k = 0; k < K; ++k)
          ref += (double)bf(x[e * R * K + r * K + k]) *
                 bf(w[((reps * copies - 1) % copies) * E * wsz + e * wsz + k * n + c]);
        maxerr = std::max(maxerr, std::abs(ref - out[e * R * n + r * n + c]) / std::abs(ref));
      }
  const double gb = E * wsz * 2 / 1e9;
  printf(
      "MODE=%d R=%3d KC=%d PF=%d: %.2f ms (%.1f GB/s, %.3f TFLOP/s), read %.2f ms (%.1f GB/s): "
      "%.0f%% of "
      "read; rel err %.1e\n",
      MODE, R, KC, PF, best[0], gb / best[0] * 1e3, 2.0 * E * R * K * n / best[0] / 1e9, best[1],
      gb / best[1] * 1e3, 100 * best[1] / best[0], maxerr);
}
