// 8 (or R) rows of sums against a block of KB bf16 weight rows of COLS columns (in L2), panel by
// panel, each panel through the chunks in turn (the kernel's order): GFLOP/s of one core by how the
// rows are chunked and how wide a panel is.
//   split8 COLS KB
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
static inline __m256 widen(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static int COLS, KB, PF;
static uint16_t* W;
static float *A, *S;
// R rows x V vectors over columns [c0, c0 + 8V) of the block
template <int R, int V>
__attribute__((noinline)) void kern(int r0, int c0) {
  __m256 s[R][V];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < V; ++i) s[r][i] = _mm256_loadu_ps(S + (r0 + r) * COLS + c0 + i * 8);
  for (int k = 0; k < KB; ++k) {
    if (PF) _mm_prefetch((const char*)(W + (size_t)(k + PF) * COLS + c0), _MM_HINT_T0);
    __m256 b[V];
#pragma GCC unroll 4
    for (int i = 0; i < V; ++i) b[i] = widen(W + (size_t)k * COLS + c0 + i * 8);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(A + (r0 + r) * KB + k);
#pragma GCC unroll 4
      for (int i = 0; i < V; ++i) s[r][i] = _mm256_fmadd_ps(av, b[i], s[r][i]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < V; ++i) _mm256_storeu_ps(S + (r0 + r) * COLS + c0 + i * 8, s[r][i]);
}
template <class F>
void time_it(const char* name, int rows, F f) {
  const int reps = 2000;
  for (int i = 0; i < 20; ++i) f();
  auto t = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) f();
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  std::printf("%-28s %6.1f GFLOP/s\n", name, 2.0 * rows * KB * COLS * reps / s / 1e9);
}
int main(int argc, char** argv) {
  COLS = argc > 1 ? atoi(argv[1]) : 768;
  KB = argc > 2 ? atoi(argv[2]) : 85;
  PF = argc > 3 ? atoi(argv[3]) : 0;
  W = (uint16_t*)aligned_alloc(64, (size_t)KB * COLS * 2);
  A = (float*)aligned_alloc(64, 16 * KB * 4);
  S = (float*)aligned_alloc(64, 16 * COLS * 4);
  for (size_t i = 0; i < (size_t)KB * COLS; ++i) W[i] = 0x3f80;
  for (int i = 0; i < 16 * KB; ++i) A[i] = 1e-3f;
  std::printf("block %d rows x %d columns (%d KiB)\n", KB, COLS, KB * COLS * 2 / 1024);
  time_it("6x2 + 2x4 (now)", 8, [] {
    for (int c = 0; c < COLS; c += 32) {
      kern<6, 2>(0, c);
      kern<6, 2>(0, c + 16);
      kern<2, 4>(6, c);
    }
  });
  time_it("4x2 + 4x2", 8, [] {
    for (int c = 0; c < COLS; c += 16) {
      kern<4, 2>(0, c);
      kern<4, 2>(4, c);
    }
  });
  time_it("4x3 + 4x3", 8, [] {
    for (int c = 0; c + 24 <= COLS; c += 24) {
      kern<4, 3>(0, c);
      kern<4, 3>(4, c);
    }
  });
  time_it("8x1", 8, [] {
    for (int c = 0; c < COLS; c += 8) kern<8, 1>(0, c);
  });
  time_it("6x2 alone", 6, [] {
    for (int c = 0; c < COLS; c += 16) kern<6, 2>(0, c);
  });
  time_it("4x3 alone", 4, [] {
    for (int c = 0; c + 24 <= COLS; c += 24) kern<4, 3>(0, c);
  });
  time_it("2x4 alone", 2, [] {
    for (int c = 0; c < COLS; c += 32) kern<2, 4>(0, c);
  });
  time_it("6x2 + 6x2 (12 rows)", 12, [] {
    for (int c = 0; c < COLS; c += 16) {
      kern<6, 2>(0, c);
      kern<6, 2>(6, c);
    }
  });
  time_it("4x3 x3 (12 rows)", 12, [] {
    for (int c = 0; c + 24 <= COLS; c += 24) {
      kern<4, 3>(0, c);
      kern<4, 3>(4, c);
      kern<4, 3>(8, c);
    }
  });
  time_it("5x2 + 5x2 (10 rows)", 10, [] {
    for (int c = 0; c < COLS; c += 16) {
      kern<5, 2>(0, c);
      kern<5, 2>(5, c);
    }
  });
  time_it("4x3 + 3x4? no: 4x3+3x3 (7)", 7, [] {
    for (int c = 0; c + 24 <= COLS; c += 24) {
      kern<4, 3>(0, c);
      kern<3, 3>(4, c);
    }
  });
  time_it("6x2 + 1x4 (7 rows, now)", 7, [] {
    for (int c = 0; c < COLS; c += 32) {
      kern<6, 2>(0, c);
      kern<6, 2>(0, c + 16);
      kern<1, 4>(6, c);
    }
  });
}
