// kCpuStream's bf16 calls on AMX (Intel Xeon with AMX-BF16), each group's weights streamed once.
// The forward against [K, n] weights (the output-contiguous form): a chunk of kChunkRows weight
// rows is repacked into the
// tiles' pair layout (two consecutive weight rows interleaved: vnni[kp][c] = (w[2kp][c],
// w[2kp + 1][c])), then every row block of the group multiplies it from L2: a tile of 16 rows x 32
// contraction elements times a tile of 16 pairs x 16 columns into a 16 x 16 f32 tile
// (tdpbf16ps), the sums kept in an f32 buffer across chunks and written once at the end. The input
// gradient against them (the contraction-contiguous form, run_dot_item) computes C's transpose,
// so that the weights load as they lie.
//
// By hand first (bench/results/ragged_dot_small-cpu-2026-11-27-7/by-hand/amx.cpp; qwen3-30b-a3b's
// forward, K 2048, n 768, 128 groups on two threads, weights cold), share of a plain read of the
// same weights: 1 / 8 / 16 / 32 / 64 rows a group 88 / 82 / 80 / 68 / 59%, 128 rows 1.07 TFLOP/s,
// where the AVX512-BF16 pair kernels ran 16 rows at ~44% of the floor and 64 at ~30%. Chunks of 256
// rows ran best (64: 76 / 42% at 16 / 64 rows, 128: 78 / 57%, 512: 80 / 54%, whole: 61 / 40%);
// software prefetches of the next chunk, in bursts or spread between the tiles, and repacking the
// next chunk in slices between the tiles' column blocks all ran slower (39-50% at 64 rows).
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu/grouped_gemm.h"
#include "cpu/transpose16.h"

// GCC 12 warns that the AVX-512 intrinsics' own headers may use an uninitialised value
// (_mm512_undefined_*, by design): not this file's code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace moekit::detail {
namespace {

constexpr int64_t kChunkRows = 256;  // weight rows repacked at a time (a multiple of 32)
// ... fewer where a chunk's pairs would pass kPairsBytes (wide rows), so that they stay in L2: on
// gpt-oss-20b's and mixtral-8x7b's forward (5.6 and 28 KiB rows) at 64 tokens 1.10-1.15x, at 512
// level (bench/results/ragged_dot_small-cpu-2026-11-27-7/amx-pairs-bytes.txt).
constexpr int64_t kPairsBytes = int64_t{1} << 20;
// The repack reads a chunk as kRepackStreams streams side by side (its pairs in that many parts, a
// pair from each in turn): a core reads this Xeon's memory faster so than front to back (as the
// floor's read probe found). By hand (bench/results/ragged_dot_small-cpu-2026-11-28-7/by-hand/;
// qwen3-30b-a3b's forward, weights cold), against one stream: 1.08-1.15x at 1-32 rows a group,
// 0.95-1.06x at 64 (2 streams 1.02-1.11x, 8 0.89-1.10x); in the library 1.05-1.18x at 128-1024
// tokens (8-64 rows a group).
constexpr int64_t kRepackStreams = 4;
constexpr int64_t kBlockCols = 64;         // the columns of one A tile's four C tiles
constexpr int64_t kSumsBytes = 512 << 10;  // an item's f32 sums at most (its columns fit them)
constexpr int64_t kMinSlabCols = 256;
// The input gradient's parts of the contraction, in 32-element steps (run_dot_item): a part of a
// column block's weights (16 KiB for two blocks of 16 weight rows) stays in L1 while every row
// block multiplies it. qwen3-30b-a3b's input gradient (24 steps), against oneDNN beside it, at
// 1024 / 2048 / 4096 tokens: one part 1.58-1.60 / 1.36-1.38 / 1.25x, parts of 8 steps 1.73-1.75 /
// 1.42-1.46 / 1.25-1.28x, of 4 or 12 steps between (bench/results/
// ragged_dot_small-cpu-2026-11-28/dlhs-parts.txt).
constexpr int64_t kDotPartSteps = 8;
// The input gradient's tiles: 3 column blocks (48 weight rows) by a row block of 16 rows, a row
// tile loaded per 3 products; where the weight rows lie a multiple of kDotAliasBytes apart, 2 x 2
// (a weight tile and a row tile per 2 products): there a weight tile's 16 rows share one L1 set,
// so a part of the weights does not stay in L1 and the weight tiles load from L2. Against oneDNN
// beside it (bench/results/ragged_dot_small-cpu-2026-11-28-2/dlhs-shape.txt), 2 x 2 -> 3 x 1 at
// 4096 tokens: qwen3-30b-a3b (rows 1536 bytes apart) 1.27-1.33 -> 1.38-1.41x, olmoe-1b-7b (2048)
// at 2048 tokens 1.46-1.50 -> 1.66-1.67x, deepseek-v2-lite (2816) level; deepseek-v3 (4096)
// 1.69-1.96 -> 1.56-1.62x.
constexpr int64_t kDotAliasBytes = 4096;
// A group whose repacked rows pass kDotRowsBytes (they no longer stay in L2 while every column
// block multiplies them) is cut into pieces, each reading the weights again: pieces whose rows fit
// half of it, where those hold kDotMinPieceRows rows or more; else (a long contraction) pieces of
// kDotSpanPieceRows rows that take their columns in spans whose sums fit kDotSumsBytes, the parts
// outermost within a span, so that a part of the repacked rows stays in L2 while every column
// block of the span multiplies it (their rows are read again once a span, the weights once a
// piece: for pieces of R rows and sums of S bytes the two reads are equal at R = sqrt(S / 4), 362
// rows). Against oneDNN beside it (bench/results/ragged_dot_small-cpu-2026-11-28-2/
// dlhs-pieces.txt), at 4096 tokens: gpt-oss-20b (512 rows a group, 2.9 MB of repacked rows;
// pieces of 176 rows) 0.75-0.78 -> 1.29-1.38x; mixtral-8x7b (1024 rows, 29 MB; spans) 0.67-0.68
// -> 0.97x, at 1024 tokens 0.82-0.86 -> 1.04-1.07x; the others' rows fit. Spans for every group
// past 1.5 MiB ran slower where the rows only just pass L2 (mixtral-8x7b at 256 tokens, 64 rows a
// group, 1.8 MB: 1.22-1.26 -> 1.01-1.13x; dlhs-spans-first-cut.txt).
constexpr int64_t kDotRowsBytes = int64_t{2} << 20;
constexpr int64_t kDotMinPieceRows = 128;
constexpr int64_t kDotSpanPieceRows = 384;
constexpr int64_t kDotSumsBytes = 512 << 10;

// The AMX kernel takes a call whose largest local group has kAmxMinRows rows or more; the pair
// kernels (on this Xeon the even/odd kernels, ragged_dot_stream.cpp) the rest. `moekit bench
// ragged_dot --preset qwen3-30b-a3b --dtype bf16 --passes fwd --impl stream`, AMX on / off, twice
// (bench/results/ragged_dot_small-cpu-2026-11-27-7/amx-vs-pairs.txt, against the one-stream
// probe): 1 / 8 / 16 / 32 tokens (0.5-2 rows a group on average) 75-87% of the floor against the
// pair kernels' 93-106%, 64 tokens (4) 85-90% against 89-90%, 128 (8) 85-86% against 66-69%.
// Against the even/odd kernels, 8 and 12 rows (ragged_dot_small-cpu-2026-11-28-8/amx-min-rows.txt):
// at 96 / 128 tokens 8 ran 1.06-1.07 / 1.06-1.12x faster.
constexpr int32_t kAmxMinRows = 8;

std::atomic<bool> amx_allowed{true};  // set_amx_for_test
// The input gradient's budgets as run (set_amx_dot_budgets_for_test).
std::atomic<int64_t> dot_rows_bytes{kDotRowsBytes}, dot_min_piece_rows{kDotMinPieceRows},
    dot_span_piece_rows{kDotSpanPieceRows}, dot_sums_bytes{kDotSumsBytes};

// How the input gradient cuts a group of `rows` rows (repacked, `row_bytes` each): into `pieces`,
// whose columns go in spans or not.
struct DotCut {
  int64_t pieces;
  bool spans;
};
DotCut dot_cut(int64_t rows, int64_t row_bytes) {
  if (rows * row_bytes <= dot_rows_bytes.load()) return {1, false};
  const int64_t fit = dot_rows_bytes.load() / 2 / row_bytes / 16 * 16;
  if (fit >= dot_min_piece_rows.load()) return {(rows + fit - 1) / fit, false};
  const int64_t most = dot_span_piece_rows.load();
  return {(rows + most - 1) / most, true};
}

#define MOEKIT_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl")))

// The CPU has AMX-BF16 (CPUID.(7,0):EDX bits 22 and 24) and the AVX-512 the repacking and the
// stores use, and Linux grants this process the tile data (arch_prctl ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA), asked once.
bool amx_granted() {
  static const bool granted = [] {
    if (!cpu_has_amx()) return false;
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl")) {
      return false;
    }
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// The tile configuration (palette 1): tiles 0-3 the sums, 4-5 A (rows a0, a1), 6-7 B. With one A
// tile the sums are 4 tiles of its rows side by side (64 columns); with two, 2 x 2 (32 columns).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
MOEKIT_AMX_TARGET void configure(int a0, int a1) {
  TileConfig t;
  for (int i = 0; i < 8; ++i) t.colsb[i] = 64;
  t.rows[0] = t.rows[1] = static_cast<uint8_t>(a0);
  t.rows[2] = t.rows[3] = static_cast<uint8_t>(a1 > 0 ? a1 : a0);
  t.rows[4] = static_cast<uint8_t>(a0);
  t.rows[5] = static_cast<uint8_t>(a1 > 0 ? a1 : 16);
  t.rows[6] = t.rows[7] = 16;
  // Not _tile_loadconfig: GCC 12 does not see that it reads the struct and drops its stores.
  asm volatile("ldtilecfg %0" ::"m"(t));
}

// vnni[kp][c] = (b[2kp][c], b[2kp + 1][c]) for kp < steps * 16 and c < width: zero past kc rows
// and past cols columns (width a multiple of 32). The pairs go in kRepackStreams streams.
MOEKIT_AMX_TARGET void repack(const uint16_t* b, int64_t ldb, int64_t kc, int64_t cols,
                              int64_t width, uint32_t* vnni) {
  alignas(64) static constexpr uint16_t kLo[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                   37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                   11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(kLo);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const int64_t pairs = (kc + 31) / 32 * 16, quarter = pairs / kRepackStreams;
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t kp = i % kRepackStreams * quarter + i / kRepackStreams;
    const uint16_t* r0 = 2 * kp < kc ? b + 2 * kp * ldb : nullptr;
    const uint16_t* r1 = 2 * kp + 1 < kc ? b + (2 * kp + 1) * ldb : nullptr;
    uint32_t* o = vnni + kp * width;
    for (int64_t c = 0; c < width; c += 32) {
      const int64_t left = cols - c;
      const __mmask32 m = left >= 32 ? ~__mmask32{0}
                          : left > 0 ? static_cast<__mmask32>((uint64_t{1} << left) - 1)
                                     : __mmask32{0};
      const __m512i x = r0 ? _mm512_maskz_loadu_epi16(m, r0 + c) : _mm512_setzero_si512();
      const __m512i y = r1 ? _mm512_maskz_loadu_epi16(m, r1 + c) : _mm512_setzero_si512();
      _mm512_store_si512(o + c, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_store_si512(o + c + 16, _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}

// sums[rows][width] (+)= a[rows][32 * steps] (lda apart) x vnni[16 * steps][width], one row block
// of at most 16 (kTiles 1) or 32 rows (kTiles 2) configured as such; `tail` (if not null): the
// last step's A, 32 columns, 64 bytes a row.
template <int kTiles>
MOEKIT_AMX_TARGET void block(const uint16_t* a, int64_t lda, int64_t steps, const uint16_t* tail,
                             const uint32_t* vnni, int64_t width, float* sums, bool first) {
  constexpr int64_t kCols = 16 * 4 / kTiles;  // columns of one pass of the four sum tiles
  const int64_t ldc = width * 4, ldb = width * 4, lda_b = lda * 2;
  for (int64_t c0 = 0; c0 < width; c0 += kCols) {
    float* s = sums + c0;
    float* s2 = kTiles == 1 ? s + 32 : s + 16 * width;
    if (first) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    } else {
      _tile_loadd(0, s, ldc);
      _tile_loadd(1, s + 16, ldc);
      _tile_loadd(2, s2, ldc);
      _tile_loadd(3, s2 + 16, ldc);
    }
    for (int64_t k = 0; k < steps; ++k) {
      const uint32_t* bk = vnni + 16 * k * width + c0;
      if (tail != nullptr && k == steps - 1) {
        _tile_loadd(4, tail, 64);
        if (kTiles == 2) _tile_loadd(5, tail + 16 * 32, 64);
      } else {
        _tile_loadd(4, a + 32 * k, lda_b);
        if (kTiles == 2) _tile_loadd(5, a + 16 * lda + 32 * k, lda_b);
      }
      _tile_loadd(6, bk, ldb);
      _tile_loadd(7, bk + 16, ldb);
      if (kTiles == 1) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, bk + 32, ldb);
        _tile_loadd(7, bk + 48, ldb);
        _tile_dpbf16ps(2, 4, 6);
        _tile_dpbf16ps(3, 4, 7);
      } else {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, s, ldc);
    _tile_stored(1, s + 16, ldc);
    _tile_stored(2, s2, ldc);
    _tile_stored(3, s2 + 16, ldc);
  }
}

// C[r][0, cols) (+)= sums[r][0, cols) for r < rows: f32, or bf16 rounded to nearest even (quiet
// NaNs), as float_to_bf16.
MOEKIT_AMX_TARGET void store(const float* sums, int64_t width, int64_t rows, int64_t cols,
                             const RowGroupedGemm& g, int64_t row, int64_t col) {
  const bool bf16 = g.out_type == DType::kBF16;
  const size_t es = dtype_size(g.out_type);
  for (int64_t r = 0; r < rows; ++r) {
    char* out = static_cast<char*>(g.c) + ((row + r) * g.ldc + col) * static_cast<int64_t>(es);
    const float* s = sums + r * width;
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 m =
          cols - c >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (cols - c)) - 1);
      __m512 v = _mm512_maskz_loadu_ps(m, s + c);
      if (!bf16) {
        float* o = reinterpret_cast<float*>(out) + c;
        if (g.accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, o));
        _mm512_mask_storeu_ps(o, m, v);
        continue;
      }
      uint16_t* o = reinterpret_cast<uint16_t*>(out) + c;
      if (g.accumulate) {
        const __m512i old =
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, o)), 16);
        v = _mm512_add_ps(v, _mm512_castsi512_ps(old));
      }
      const __m512i u = _mm512_castps_si512(v);
      const __mmask16 nan = _mm512_cmpgt_epu32_mask(
          _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
      const __m512i bias =
          _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                           _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
      const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
      const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
      _mm256_mask_storeu_epi16(o, m,
                               _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet)));
    }
  }
}

// This thread's buffer of at least `bytes`, 64-byte aligned, grown as needed (one per use).
template <int kUse>
void* thread_buffer(size_t bytes) {
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<void, Free> p;
  thread_local size_t size = 0;
  if (bytes > size) {
    size = (bytes + 63) / 64 * 64;
    p.reset(std::aligned_alloc(64, size));
  }
  return p.get();
}

struct Item {
  int64_t j, row, rows, col, cols;
  bool spans = false;  // the input gradient: its columns in spans (dot_cut)
};

// Whether a local group has `rows` rows or more.
bool has_group_of(const RowGroupedGemm& g, int64_t rows) {
  for (int64_t j = 0; j < g.groups.num_local; ++j) {
    if (g.groups.sizes[g.groups.offset + j] >= rows) return true;
  }
  return false;
}

// One item: rows [row, row + rows) of group j (local j) against its weights' columns [col, col +
// cols).
MOEKIT_AMX_TARGET void run_item(const RowGroupedGemm& g, const Item& it) {
  const auto* a = static_cast<const uint16_t*>(g.a) + it.row * g.lda;
  const auto* b = static_cast<const uint16_t*>(g.b) + it.j * g.b_batch + it.col;
  const int64_t width = (it.cols + kBlockCols - 1) / kBlockCols * kBlockCols;
  auto* sums = static_cast<float*>(thread_buffer<0>(static_cast<size_t>(it.rows * width) * 4));
  auto* vnni =
      static_cast<uint32_t*>(thread_buffer<1>(static_cast<size_t>(kChunkRows / 2 * width) * 4));
  const int64_t chunk_rows =
      std::clamp<int64_t>(kPairsBytes / (2 * width) / 32 * 32, 32, kChunkRows);
  const int64_t blocks = (it.rows + 31) / 32;
  uint16_t* tails = nullptr;  // the last step's A, zero-padded to 32 columns, per row block
  int config = -1;            // the rows of the configured row block
  for (int64_t k0 = 0; k0 < g.kc; k0 += chunk_rows) {
    const int64_t kc = std::min(chunk_rows, g.kc - k0), steps = (kc + 31) / 32;
    repack(b + k0 * g.b_s0, g.b_s0, kc, it.cols, width, vnni);
    if (kc % 32 != 0) {
      tails = static_cast<uint16_t*>(thread_buffer<2>(static_cast<size_t>(blocks * 32 * 32) * 2));
      std::memset(tails, 0, static_cast<size_t>(blocks * 32 * 32) * 2);
      for (int64_t r = 0; r < it.rows; ++r) {
        std::memcpy(tails + r * 32, a + r * g.lda + k0 + (steps - 1) * 32,
                    static_cast<size_t>(kc % 32) * 2);
      }
    }
    for (int64_t r0 = 0; r0 < it.rows; r0 += 32) {
      const int rows = static_cast<int>(std::min<int64_t>(32, it.rows - r0));
      if (rows != config) {
        configure(std::min(rows, 16), rows > 16 ? rows - 16 : 0);
        config = rows;
      }
      const uint16_t* tail = kc % 32 != 0 ? tails + r0 * 32 : nullptr;
      if (rows <= 16) {
        block<1>(a + r0 * g.lda + k0, g.lda, steps, tail, vnni, width, sums + r0 * width, k0 == 0);
      } else {
        block<2>(a + r0 * g.lda + k0, g.lda, steps, tail, vnni, width, sums + r0 * width, k0 == 0);
      }
    }
  }
  store(sums, width, it.rows, it.cols, g, it.row, it.col);
}

// out[j][i] = in[i][j] for i, j < 16: 32-bit elements, the rows of `in` ld_in_bytes apart (any
// alignment), those of `out` ld_out elements apart.
MOEKIT_AMX_TARGET inline void transpose16(const void* in, int64_t ld_in_bytes, void* out,
                                          int64_t ld_out) {
  __m512i r[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    r[i] = _mm512_loadu_si512(static_cast<const char*>(in) + i * ld_in_bytes);
  }
  transpose16x16(r);
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(static_cast<uint32_t*>(out) + i * ld_out, r[i]);
}

// The contraction-contiguous form (the input gradient against [K, n] weights): C[r][c] =
// sum_k A[r][k] B[c][k], B's rows (weight rows, one per output column) contiguous along the
// contraction. The tiles compute C's transpose, so that the weights load straight from memory
// as the A tiles (16 weight rows x 32 contraction elements) and the group's rows are the ones
// repacked: y[kp][r] = (A[r][2kp], A[r][2kp + 1]), zero past kc and past the rows (ld_y columns,
// a multiple of 16); 16 rows x 16 pairs at a time in registers, the rest one by one.
MOEKIT_AMX_TARGET void repack_rows(const uint16_t* a, int64_t lda, int64_t rows, int64_t kc,
                                   int64_t ld_y, uint32_t* y) {
  const int64_t pairs = (kc + 31) / 32 * 16, whole = kc / 2, blocked = whole / 16 * 16;
  std::memset(y, 0, static_cast<size_t>(pairs * ld_y) * 4);
  const int64_t blocked_rows = rows / 16 * 16;
  for (int64_t r = 0; r < blocked_rows; r += 16) {
    for (int64_t kp = 0; kp < blocked; kp += 16) {
      transpose16(a + r * lda + 2 * kp, lda * 2, y + kp * ld_y + r, ld_y);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = a + r * lda;
    for (int64_t kp = r < blocked_rows ? blocked : 0; kp < whole; ++kp) {
      uint32_t v;
      std::memcpy(&v, row + 2 * kp, 4);
      y[kp * ld_y + r] = v;
    }
    if (kc % 2 != 0) y[whole * ld_y + r] = row[kc - 1];
  }
}

// Tiles of C's transpose: rows [c0, c0 + 16 * kCb) of B (weight rows, `live` of the last block's
// 16 configured) against the rows [r0, r0 + 16 * kRb) of y, over `steps` steps of the contraction
// from b and y: out (+)= their products (added to out's tiles where `add`, else written). `tail`
// (if not null): the last step's weights, zero-padded to 32 elements, 64 bytes a row, kCb blocks
// of 16 rows.
template <int kCb, int kRb>
MOEKIT_AMX_TARGET void dot_tiles(const uint16_t* b, int64_t ldb, int64_t steps,
                                 const uint16_t* tail, const uint32_t* y, int64_t ld_y,
                                 float (*out)[16][16], bool add) {
  // The tiles (the intrinsics take literal numbers): sums first (c-block major), then the weight
  // tiles, then the row tiles. 3 x 1: sums 0-2, weights 3-5, rows 6; 1 x 1: 0, 1, 2; 2 x 2: sums
  // 0-3, weights 4-5, rows 6-7; 1 x 2: sums 0-1, weights 2, rows 3-4.
  static_assert((kCb == 3 && kRb == 1) || (kCb == 1 && kRb == 1) || (kCb == 2 && kRb == 2) ||
                (kCb == 1 && kRb == 2));
  if (add) {
    _tile_loadd(0, out[0], 64);
    if constexpr (kCb * kRb > 1) _tile_loadd(1, out[1], 64);
    if constexpr (kCb * kRb > 2) _tile_loadd(2, out[2], 64);
    if constexpr (kCb * kRb > 3) _tile_loadd(3, out[3], 64);
  } else {
    _tile_zero(0);
    if constexpr (kCb * kRb > 1) _tile_zero(1);
    if constexpr (kCb * kRb > 2) _tile_zero(2);
    if constexpr (kCb * kRb > 3) _tile_zero(3);
  }
  const int64_t ldb_b = ldb * 2, ldy_b = ld_y * 4;
  for (int64_t k = 0; k < steps; ++k) {
    const bool last = tail != nullptr && k == steps - 1;
    const uint16_t* w0 = last ? tail : b + 32 * k;
    const int64_t stride = last ? 64 : ldb_b, block = last ? 16 * 32 : 16 * ldb;
    const uint32_t* yk = y + 16 * k * ld_y;
    if constexpr (kCb == 3) {
      _tile_loadd(3, w0, stride);
      _tile_loadd(4, w0 + block, stride);
      _tile_loadd(5, w0 + 2 * block, stride);
      _tile_loadd(6, yk, ldy_b);
      _tile_dpbf16ps(0, 3, 6);
      _tile_dpbf16ps(1, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
    } else if constexpr (kCb == 1 && kRb == 1) {
      _tile_loadd(1, w0, stride);
      _tile_loadd(2, yk, ldy_b);
      _tile_dpbf16ps(0, 1, 2);
    } else if constexpr (kCb == 2) {
      _tile_loadd(4, w0, stride);
      _tile_loadd(5, w0 + block, stride);
      _tile_loadd(6, yk, ldy_b);
      _tile_loadd(7, yk + 16, ldy_b);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    } else {
      _tile_loadd(2, w0, stride);
      _tile_loadd(3, yk, ldy_b);
      _tile_loadd(4, yk + 16, ldy_b);
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 2, 4);
    }
  }
  _tile_stored(0, out[0], 64);
  if constexpr (kCb * kRb > 1) _tile_stored(1, out[1], 64);
  if constexpr (kCb * kRb > 2) _tile_stored(2, out[2], 64);
  if constexpr (kCb * kRb > 3) _tile_stored(3, out[3], 64);
}

// The tile configuration of dot_tiles<kCb, kRb>: sums and weight tiles of `live` rows (the
// weight rows of a block), row tiles of 16.
MOEKIT_AMX_TARGET void configure_dot(int cb, int rb, int live) {
  TileConfig t;  // (a tile left unused keeps 0 rows and 0 bytes: anything else is refused)
  const int w = cb * rb;
  for (int i = 0; i < w + cb + rb; ++i) t.colsb[i] = 64;
  for (int i = 0; i < w + cb; ++i) t.rows[i] = static_cast<uint8_t>(live);
  for (int i = w + cb; i < w + cb + rb; ++i) t.rows[i] = 16;
  asm volatile("ldtilecfg %0" ::"m"(t));
}

// One item of the contraction-contiguous form: rows [row, row + rows) of group j against its
// weight rows (output columns) [col, col + cols).
MOEKIT_AMX_TARGET void run_dot_item(const RowGroupedGemm& g, const Item& it) {
  const auto* a = static_cast<const uint16_t*>(g.a) + it.row * g.lda;
  const auto* b = static_cast<const uint16_t*>(g.b) + it.j * g.b_batch;
  const bool wide = it.rows > 16 && g.b_s1 * 2 % kDotAliasBytes == 0;
  const int rb = wide ? 2 : 1, most_cb = wide ? 2 : 3;
  const int64_t ld_y = (it.rows + 16 * rb - 1) / (16 * rb) * (16 * rb);
  const int64_t steps = (g.kc + 31) / 32, rem = g.kc % 32;
  auto* y = static_cast<uint32_t*>(thread_buffer<3>(static_cast<size_t>(steps * 16 * ld_y) * 4));
  repack_rows(a, g.lda, it.rows, g.kc, ld_y, y);
  auto* tail = rem != 0 ? static_cast<uint16_t*>(thread_buffer<4>(3 * 16 * 32 * 2)) : nullptr;
  // With several row blocks, the contraction goes in parts of kDotPartSteps steps (each row
  // block's sum tiles kept in `sums` between them), so that a part of the column block's weights
  // stays in L1 while every row block multiplies it. The columns go in spans, the parts outermost
  // within each: one column block a span, or, where its group's dot_cut said so (a long
  // contraction whose rows pass kDotRowsBytes), as many as kDotSumsBytes of sums hold. One row
  // block: the whole contraction at once, one span. `sums`: [row block][the span's 16-column
  // tiles][rb] tiles.
  const int64_t blocks = ld_y / (16 * rb);
  const bool parts = blocks > 1;
  const int64_t part = parts ? kDotPartSteps : steps;
  const int64_t unit = 16 * most_cb;  // the columns of a whole column block
  const int64_t span = !parts ? it.cols
                       : !it.spans
                           ? unit
                           : std::max(unit, dot_sums_bytes.load() / (ld_y * 4) / unit * unit);
  const int64_t span_tiles = parts ? (std::min(span, it.cols) + 15) / 16 : most_cb;
  auto* sums = static_cast<float(*)[16][16]>(
      thread_buffer<5>(static_cast<size_t>(blocks * span_tiles * rb) * sizeof(float[16][16])));
  alignas(64) float rows_of[16][16];  // one sum tile transposed: [r][c]
  int config = -1;                    // cb * 32 + live of the configured blocks
  const int64_t end = it.col + it.cols;
  for (int64_t c0 = it.col; c0 < end; c0 += span) {
    const int64_t c1 = std::min(end, c0 + span);
    for (int64_t k0 = 0; k0 < steps; k0 += part) {
      const int64_t k1 = std::min(steps, k0 + part);
      const uint32_t* yk = y + 16 * k0 * ld_y;
      for (int64_t c = c0; c < c1;) {
        const int cb = c1 - c >= unit ? most_cb : 1;
        const int live = static_cast<int>(std::min<int64_t>(16, c1 - c));
        if (cb * 32 + live != config) {
          configure_dot(cb, rb, live);
          config = cb * 32 + live;
        }
        const uint16_t* last = nullptr;
        if (tail != nullptr && k1 == steps) {  // the last step's weights, zero-padded
          std::memset(tail, 0, 3 * 16 * 32 * 2);
          const int64_t w_rows = cb > 1 ? 16 * cb : live;
          for (int64_t i = 0; i < w_rows; ++i) {
            std::memcpy(tail + i * 32, b + (c + i) * g.b_s1 + (steps - 1) * 32,
                        static_cast<size_t>(rem) * 2);
          }
          last = tail;
        }
        const uint16_t* bc = b + c * g.b_s1 + 32 * k0;
        const int64_t tile0 = parts ? (c - c0) / 16 : 0;  // the column block's first sum tile
        for (int64_t r0 = 0; r0 < it.rows; r0 += 16 * rb) {
          float(*s)[16][16] = sums + (r0 / (16 * rb) * span_tiles + tile0) * rb;
          const bool add = k0 > 0;
          if (rb == 1) {
            if (cb == 3) dot_tiles<3, 1>(bc, g.b_s1, k1 - k0, last, yk + r0, ld_y, s, add);
            if (cb == 1) dot_tiles<1, 1>(bc, g.b_s1, k1 - k0, last, yk + r0, ld_y, s, add);
          } else {
            if (cb == 2) dot_tiles<2, 2>(bc, g.b_s1, k1 - k0, last, yk + r0, ld_y, s, add);
            if (cb == 1) dot_tiles<1, 2>(bc, g.b_s1, k1 - k0, last, yk + r0, ld_y, s, add);
          }
          if (k1 < steps) continue;
          for (int ci = 0; ci < cb; ++ci) {
            for (int ri = 0; ri < rb; ++ri) {
              const int64_t r = r0 + 16 * ri, rows = std::min<int64_t>(16, it.rows - r);
              if (rows <= 0) continue;
              transpose16(s[ci * rb + ri][0], 64, rows_of[0], 16);
              const int64_t cols = cb > 1 ? 16 : live;
              store(rows_of[0], 16, rows, cols, g, it.row + r, c + 16 * ci);
            }
          }
        }
        c += cb > 1 ? 16 * cb : live;
      }
    }
  }
}

}  // namespace

bool cpu_has_amx() {
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    return (d & (1u << 22)) != 0 && (d & (1u << 24)) != 0;
  }();
  return has;
}

bool amx_forward_available(const RowGroupedGemm& g) {
  return g.in_type == DType::kBF16 && g.b_s1 == 1 && amx_allowed.load() && amx_granted();
}

bool amx_forward_takes(const RowGroupedGemm& g) {
  return amx_forward_available(g) && has_group_of(g, kAmxMinRows);
}

void set_amx_for_test(bool allowed) { amx_allowed = allowed; }

void set_amx_dot_budgets_for_test(int64_t rows_bytes, int64_t min_piece_rows,
                                  int64_t span_piece_rows, int64_t sums_bytes) {
  dot_rows_bytes = rows_bytes > 0 ? rows_bytes : kDotRowsBytes;
  dot_min_piece_rows = min_piece_rows > 0 ? min_piece_rows : kDotMinPieceRows;
  dot_span_piece_rows = span_piece_rows > 0 ? span_piece_rows : kDotSpanPieceRows;
  dot_sums_bytes = sums_bytes > 0 ? sums_bytes : kDotSumsBytes;
}

bool amx_dot_available(const RowGroupedGemm& g) {
  return g.in_type == DType::kBF16 && g.b_s0 == 1 && g.b_s1 != 1 && amx_allowed.load() &&
         amx_granted();
}

bool amx_dot_takes(const RowGroupedGemm& g) {
  return amx_dot_available(g) && has_group_of(g, kAmxMinRows);
}

void row_grouped_gemm_amx(const RowGroupedGemm& g) {
  // Items: each group with rows in slabs of whole kBlockCols columns (the output-contiguous form:
  // whose sums fit kSumsBytes; the other keeps no sums), and where that leaves fewer items than
  // threads, in as many slabs as threads.
  const int64_t threads = omp_get_max_threads();
  std::vector<Item> items;
  int64_t busy = 0, most = 0;
  for (int64_t j = 0; j < g.groups.num_local; ++j) {
    const int64_t rows = g.groups.sizes[g.groups.offset + j];
    busy += rows > 0;
    most = std::max(most, rows);
  }
  const int64_t blocks = (g.n + kBlockCols - 1) / kBlockCols;
  const bool dot = g.b_s1 != 1;
  const int64_t fit =
      dot ? g.n : std::max<int64_t>(kMinSlabCols, kSumsBytes / (4 * std::max<int64_t>(most, 1)));
  int64_t slabs = (g.n + fit - 1) / fit;
  if (busy * slabs < threads) slabs = (threads + busy - 1) / std::max<int64_t>(busy, 1);
  slabs = std::min(slabs, blocks);
  int64_t row = local_rows(g.groups).begin;
  for (int64_t j = 0; j < g.groups.num_local; ++j) {
    const int64_t rows = g.groups.sizes[g.groups.offset + j];
    const DotCut cut = dot ? dot_cut(rows, g.kc * 2) : DotCut{1, false};
    for (int64_t p = 0; p < cut.pieces; ++p) {
      const int64_t r0 = rows * p / cut.pieces, r1 = rows * (p + 1) / cut.pieces;
      for (int64_t s = 0; s < slabs && r1 > r0; ++s) {
        const int64_t c0 = blocks * s / slabs * kBlockCols;
        const int64_t c1 = std::min(g.n, blocks * (s + 1) / slabs * kBlockCols);
        if (c1 > c0) items.push_back({j, row + r0, r1 - r0, c0, c1 - c0, cut.spans});
      }
    }
    row += rows;
  }
  const auto count = static_cast<int64_t>(items.size());
#pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    for (int64_t i = count * t / n; i < count * (t + 1) / n; ++i) {
      if (dot) {
        run_dot_item(g, items[i]);
      } else {
        run_item(g, items[i]);
      }
    }
  }
}

}  // namespace moekit::detail
