// ragged_dot's forward (and the input gradient, on the transposes) on packed weights
// (RaggedDotOptions::rhs_packed, pack_ragged_rhs): each panel of 32 output columns holds its
// whole contraction front to back (as bf16 pairs, or one f32 a row), so a chunk of a group's rows
// walks one panel from its first word to its last with every row's 32 sums in registers, and
// each thread reads its run of panels as one sequential stream. A group of one chunk walks the
// panel once with its sums in registers throughout. The chunks after a group's first read the
// panel again from L2 (a panel of a contraction of K takes 64 K bytes in bf16: 448 KiB at
// deepseek-v3's 7168; twice that in f32, past a 512 KiB L2), so where L2 does not hold two
// panels such a group walks the panel in blocks of the contraction of an eighth of L2
// (packed_block_steps), every chunk over a block before the next block, each chunk's sums kept
// in a tile between blocks (a band of at most 64 rows at a time), while prefetching the next
// block (Ahead, below). On a Zen 3 (512 KiB of L2) deepseek-v3's forward in blocks of 256-1024
// steps against unblocked, in turn: f32 at 128 and 512 tokens 1.01-1.27x, bf16 at 128 tokens
// 0.98-1.15x, bf16 at 256-1024 tokens (halves) 0.84-1.11x, level within the host's noise
// (bench/results/ragged_dot_packed_blocks-cpu-2026-11-30/). A row's sums run over the
// contraction in one order either way: the same bits blocked or not. A chunk is at most 8 rows
// (on AVX512-BF16: 16 sums in registers; 12 rows as one chunk ran 1.2-1.3x slower than as two
// chunks of 6, by hand: bench/results/ragged_dot_small-cpu-2026-11-29-5/ chunks.txt; on AVX2's
// 16 registers, 3 rows in f32 (kFloatRows), and in bf16 2, or for groups of many rows 4 over
// each half of the panel in turn: kHalves).
//
// Three kernels: for bf16, on a CPU with AVX512-BF16 the pairs multiply as they lie (vdpbf16ps,
// written with intrinsics for that target and chosen at run time); elsewhere, through Highway,
// each 32-bit lane's two bf16 widen to f32 (the even one by a shift, the odd one by a mask) for
// two FMAs. For f32 (one contraction row a step), Highway's FMAs on the panel's row as it lies.
// A row's sums run over the contraction in one order whatever the other rows, the chunk it falls
// in or the threads: the batch-invariant mode takes this path as it is.
//
// CMakeLists.txt compiles this file with -falign-loops=64: where the kernels' loops fall moved
// their speed by 5-12% on a Zen 3 (bench/results/ragged_dot_packed_align-cpu-2026-11-30/).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/ragged_dot_packed.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Must come after foreach_target.h.
#include <hwy/highway.h>
#include <immintrin.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/convert.h"
#include "cpu/grouped_gemm.h"
#include "cpu/stream.h"

#ifndef MOEKIT_RAGGED_DOT_PACKED_DECL
#define MOEKIT_RAGGED_DOT_PACKED_DECL
namespace moekit::detail::packed {

// Whether the calls run the AVX512-BF16 kernel: where the CPU has it, unless a test says not.
bool runs_pairs();
constexpr int64_t kPanel = kPackedPanel;
// The most rows of a chunk on AVX512-BF16 (2 x 8 sums of 16 lanes in registers).
constexpr int kPairRows = 8;
// A band of a group's rows: those whose sums a thread keeps between blocks of the contraction.
constexpr int kBandRows = 64;
// A band's sums as the kernels leave them: [rows][kPanel] f32 (8 KiB), a chunk's from its first
// row and the first column its kernel covers.
using Tile = float[kBandRows][kPanel];
// Steps (panel rows) a block of the contraction takes: packed_block_steps of this machine.
int64_t block_steps();
// Lines a kernel prefetches into L2, a line every 2^shift contraction steps: its share of the
// next panel's, where a group's rows take several chunks. The first chunk of a panel waits on the
// memory and the others compute from L2; with each chunk fetching its share of the next panel,
// every chunk computes from L2 (qwen3-30b-a3b at 16 rows a group 1.10-1.16x faster in f32 and
// bf16, mixtral-8x7b's gate|up 1.10-1.18x; deepseek-v3's panels of 448-896 KiB, two of which L2
// does not hold, level: bench/results/ragged_dot_packed_f32-cpu-2026-11-29/ab-ahead.txt). Where a
// group's panel goes in blocks of the contraction, the next block's (packed_block_steps). Each
// chunk takes an equal share spread evenly over its steps, at about the rate the memory gives:
// on a Zen 3, where a line a step from the first two chunks had them wait on the memory while
// the rest ran without reading it, 1.02-1.22x faster in f32 at 8-128 rows a group and 1.07-1.12x
// in bf16 at 8-32, in a slower phase of the host 0.99-1.14x (in one process, alternating:
// bench/results/ragged_dot_packed_rows3-cpu-2026-12-01/spread.txt).
struct Ahead {
  const char* p = nullptr;
  int64_t lines = 0;
  int shift = 0;
};
inline void prefetch_step(const Ahead& ahead, int64_t step) {
  const int64_t line = step >> ahead.shift;
  if (line < ahead.lines && line << ahead.shift == step) prefetch_line<false>(ahead.p + 64 * line);
}

// kernel.template operator()<rows>() for 1 <= rows <= R: a kernel compiled for each chunk height.
template <int R, class Kernel>
void with_rows(int rows, const Kernel& kernel) {
  if constexpr (R > 1) {
    if (rows < R) return with_rows<R - 1>(rows, kernel);
  }
  kernel.template operator()<R>();
}

// Adds the first `cols` sums of `rows` rows (kPanel apart from `sums`) to (accumulate) or writes
// them over c's rows from `row`, columns from `col`.
inline void store_tile(const RowGroupedGemm& g, const float* sums, int rows, int64_t row,
                       int64_t col, int64_t cols) {
  for (int r = 0; r < rows; ++r) {
    const int64_t o = (row + r) * g.ldc + col;
    for (int64_t c = 0; c < cols; ++c) {
      const float add = g.accumulate ? load_as_float(g.c, g.out_type, o + c) : 0.f;
      store_float(g.c, g.out_type, o + c, sums[r * kPanel + c] + add);
    }
  }
}

// The AVX512-BF16 kernel: sums[r][c] (rows kPanel apart) = (resume ? sums[r][c] : 0) + the sum
// over k < kc of A[r][k] * the panel's (k, c), for r < rows <= kPairRows; A's rows lda apart (bf16
// bits), the panel's pairs from `panel`.
void pairs_panel(int rows, const uint16_t* a, int64_t lda, int64_t kc, const uint32_t* panel,
                 float* sums, bool resume, Ahead ahead);

}  // namespace moekit::detail::packed
#endif  // MOEKIT_RAGGED_DOT_PACKED_DECL

HWY_BEFORE_NAMESPACE();
namespace moekit::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
namespace {

using D = hn::ScalableTag<float>;
using DU = hn::RebindToUnsigned<D>;
constexpr size_t kLanes = HWY_LANES(float);
// Vectors a panel's 32 columns take, and the most rows of a chunk over them: sums in at most half
// of the target's vector registers (the rest for the panel's widened pairs).
constexpr int kVecs = static_cast<int>(packed::kPanel / kLanes);
constexpr int kRegisters = HWY_TARGET <= HWY_AVX3 ? 32 : 16;
constexpr int kPanelRows = std::clamp(kRegisters / 2 / kVecs, 1, packed::kPairRows);
// f32 on 16 registers (AVX2): the sums take all but one (A's broadcast), 3 rows of 4 vectors,
// and FloatPanel reads the panel's vectors as its FMAs' memory operands (from L1, a panel row's
// two lines once a row; GCC keeps 3 of the 4 in the spare registers). On a Zen 3 core, from L1
// or L2, 3 rows x 32 columns ran 77-84 GFLOP/s against 37-48 for the 2 rows taken before (whose
// panel vectors GCC folded into the FMAs too: 10 loads to 8 FMAs, on 8 chains of sums; the
// core's FMA peak 85-95), and in the call on cold weights groups of 8-16 rows ran
// 1.12-1.44x faster in 3-row chunks, 2-4 rows level (bench/results/
// ragged_dot_packed_rows3-cpu-2026-12-01/). The whole panel so taken is level with or faster than
// the halves below at 17-128 rows (1.00-1.10x), so f32 no longer takes them.
constexpr int kFloatRows =
    kRegisters == 16 ? std::clamp((kRegisters - 1) / kVecs, 1, packed::kPairRows) : kPanelRows;
// bf16 on 16 registers (AVX2: 2 rows a chunk over the whole panel, each chunk re-reading the
// panel from L2 for 16 FMAs a step to 4 loads and 12 widening instructions): a group of many rows
// takes each half of the panel in turn (each of a panel row's two cache lines read by one of
// them), in chunks of up to 4 rows (8 sums, beside 4 widened vectors and 2 broadcasts). Few rows
// keep the whole panel: its first pass reads the memory as one stream, where the halves' first
// pass reads every other line.
constexpr bool kHalves = kRegisters == 16 && kVecs >= 2;
constexpr int kHalfVecs = std::max(kVecs / 2, 1);
constexpr int kHalfWideRows = std::clamp(8 / kHalfVecs, 1, packed::kPairRows);
// The fewest rows of a bf16 group that takes the halves: measured on a Zen 3 (qwen3-30b-a3b, 2-32
// rows a group, two rounds), the halves ran 0.85-0.9x the whole panel's speed at 4 rows, 1.0-1.24x
// at 8, 0.76x and 1.21x at 16, 1.23-1.29x at 32
// (bench/results/ragged_dot_packed-avx2-cpu-2026-11-30/halves.txt). With the whole panel's
// kernel in its rows-first form (WidePanel), in one process: the whole panel at 8-32 rows
// 0.90-0.98x the halves' speed, the halves from 4 or 6 rows 0.95-1.05x
// (bench/results/ragged_dot_packed_bf16-cpu-2026-12-01/).
constexpr int64_t kHalvesFrom = 8;

// R rows' sums over V vectors of columns, in registers: zero to start or (resume) loaded from
// `tile` (rows kPanel apart), stored back there.
template <int R, int V>
struct Sums {
  hn::Vec<D> v[R][V];
  Sums(const float* tile, bool resume) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) {
        v[r][j] = resume ? hn::LoadU(D(), tile + r * packed::kPanel + j * kLanes) : hn::Zero(D());
      }
  }
  hn::Vec<D>* operator[](int r) { return v[r]; }
  void Store(float* tile) const {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) hn::StoreU(v[r][j], D(), tile + r * packed::kPanel + j * kLanes);
  }
};

// Widened from a panel's pairs: sums[r][c] as pairs_panel's for c < V * kLanes, on f32 FMA,
// `panel` at the chunk's first column (its rows still kPanel words apart). Where the registers
// hold every row's two widened A values beside the sums (kRowsFirst; on AVX2 chunks of 1-2 rows
// over the whole panel, 1-3 over a half), those come first and the panel's vectors one at a time
// (2 live); else the panel's V vectors widen first and each row's pair in turn. A sum's terms
// run in one order either way: the same bits. An odd contraction's last pair is a step of its
// own, so the loop tests nothing but the prefetch. On a Zen 3 the 2 x 32 chunk, whose
// panel-first form kept 3 of its 19 registers' worth on the stack, ran 60-68 GFLOP/s alone
// against 41-42 in that form; in the call, in one process against the kernel before (which
// tested for the last pair each step), qwen3-30b-a3b's forward 0.97-1.07x at 4 rows a group,
// 1.01-1.11x at 6 and 1.03-1.19x at 8-64 (the halves), deepseek-v3's 1.06-1.13x at 4 and
// 1.12-1.21x at 64, 2 rows (memory-bound) and 256 level
// (bench/results/ragged_dot_packed_bf16-cpu-2026-12-01/).
template <int R, int V>
HWY_NOINLINE void WidePanel(const uint16_t* a, int64_t lda, int64_t kc, const uint32_t* panel,
                            float* sums, bool resume, packed::Ahead ahead) {
  const D d;
  const DU du;
  Sums<R, V> s(sums, resume);
  const auto high = hn::Set(du, 0xffff0000u);
  constexpr bool kRowsFirst = R * V + 2 * R + 3 <= kRegisters;  // sums, A's values, 2, the mask
  // Pair kp of the contraction; kLastOdd: the last of an odd one, whose second row is past A's
  // rows (not read). Compiled apart, so that the loop's steps test nothing.
  auto step = [&](int64_t kp, auto last_odd) __attribute__((always_inline)) {
    constexpr bool kLastOdd = decltype(last_odd)::value;
    packed::prefetch_step(ahead, kp);
    const uint32_t* row = panel + kp * packed::kPanel;
    // Row r's pair broadcast and widened as the panel's (bf16 is f32's upper half): a0, a1.
    auto widen_a = [&](int r, hn::Vec<D>& a0, hn::Vec<D>& a1) __attribute__((always_inline)) {
      const uint16_t* ar = a + r * lda + 2 * kp;
      uint32_t w = ar[0];
      if constexpr (!kLastOdd) std::memcpy(&w, ar, sizeof(w));
      const auto x = hn::Set(du, w);
      a0 = hn::BitCast(d, hn::ShiftLeft<16>(x));
      a1 = hn::BitCast(d, hn::And(x, high));
    };
    if constexpr (kRowsFirst) {
      hn::Vec<D> a0[R], a1[R];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) widen_a(r, a0[r], a1[r]);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        const auto x = hn::LoadU(du, row + v * kLanes);
        const auto even = hn::BitCast(d, hn::ShiftLeft<16>(x));
        const auto odd = hn::BitCast(d, hn::And(x, high));
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          s[r][v] = hn::MulAdd(a0[r], even, s[r][v]);
          s[r][v] = hn::MulAdd(a1[r], odd, s[r][v]);
        }
      }
    } else {
      hn::Vec<D> even[V], odd[V];
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        const auto x = hn::LoadU(du, row + v * kLanes);
        even[v] = hn::BitCast(d, hn::ShiftLeft<16>(x));
        odd[v] = hn::BitCast(d, hn::And(x, high));
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        hn::Vec<D> a0, a1;
        widen_a(r, a0, a1);
#pragma GCC unroll 8
        for (int v = 0; v < V; ++v) {
          s[r][v] = hn::MulAdd(a0, even[v], s[r][v]);
          s[r][v] = hn::MulAdd(a1, odd[v], s[r][v]);
        }
      }
    }
  };
  const int64_t full = kc / 2;
  for (int64_t kp = 0; kp < full; ++kp) step(kp, std::false_type{});
  if (kc % 2 != 0) step(full, std::true_type{});
  s.Store(sums);
}

// The f32 kernel: sums[r][c] = (resume ? sums[r][c] : 0) + the sum over k < kc of A[r][k] * the
// panel's (k, c) for c < V * kLanes, the panel one f32 a column per contraction row (kPanel apart)
// from the chunk's first column; A's rows lda apart. The panel row's V vectors are loaded once
// where they fit in the registers beside the sums and a broadcast, else read by each row's FMAs
// (kFloatRows).
template <int R, int V>
HWY_NOINLINE void FloatPanel(const float* a, int64_t lda, int64_t kc, const float* panel,
                             float* sums, bool resume, packed::Ahead ahead) {
  const D d;
  Sums<R, V> s(sums, resume);
  constexpr bool kHeld = R * V + V + 1 <= kRegisters;
  for (int64_t k = 0; k < kc; ++k) {
    packed::prefetch_step(ahead, k);
    const float* row = panel + k * packed::kPanel;
    hn::Vec<D> b[kHeld ? V : 1];
    if constexpr (kHeld) {
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) b[v] = hn::LoadU(d, row + v * kLanes);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const auto x = hn::Set(d, a[r * lda + k]);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        s[r][v] = hn::MulAdd(x, kHeld ? b[v] : hn::LoadU(d, row + v * kLanes), s[r][v]);
      }
    }
  }
  s.Store(sums);
}

// A chunk of `rows` rows over the whole panel from `panel` (f32) in kernels of up to kFloatRows
// rows, or over V vectors of its columns (bf16 pairs widened) in kernels of up to WideRows.
void FloatChunk(int rows, const char* a, int64_t lda, int64_t kc, const char* panel, float* sums,
                bool resume, packed::Ahead ahead) {
  const auto* a32 = reinterpret_cast<const float*>(a);
  const auto* p32 = reinterpret_cast<const float*>(panel);
  packed::with_rows<kFloatRows>(
      rows, [&]<int R>() { FloatPanel<R, kVecs>(a32, lda, kc, p32, sums, resume, ahead); });
}
template <int V, int WideRows>
void WideChunk(int rows, const char* a, int64_t lda, int64_t kc, const char* panel, float* sums,
               bool resume, packed::Ahead ahead) {
  const auto* a16 = reinterpret_cast<const uint16_t*>(a);
  const auto* pairs = reinterpret_cast<const uint32_t*>(panel);
  packed::with_rows<WideRows>(
      rows, [&]<int R>() { WidePanel<R, V>(a16, lda, kc, pairs, sums, resume, ahead); });
}

}  // namespace

// The call: units of (local group, panel) split over the threads in contiguous runs of near-equal
// cost (a panel's bytes, times its group's rows over 16 past 16 rows, where the FMAs take longer
// than the read), each unit's columns whole or in halves (kHalves), their rows in the fewest
// chunks of near-equal size.
void RunPacked(const RowGroupedGemm& g) {
  const bool f32 = g.in_type == DType::kF32, pairs = !f32 && packed::runs_pairs();
  // A panel's steps (rows of words), and the most a block of them takes.
  const int64_t steps = f32 ? g.kc : (g.kc + 1) / 2, step_k = f32 ? 1 : 2;
  const int64_t most_block = packed::block_steps();
  const int64_t panels = (g.n + packed::kPanel - 1) / packed::kPanel;
  struct Group {
    int64_t j, row, rows;
  };
  std::vector<Group> busy;
  std::vector<int64_t> ends;  // cumulative cost at the end of each busy group's panels
  int64_t row = local_rows(g.groups).begin, cost = 0;
  for (int64_t j = 0; j < g.groups.num_local; ++j) {
    const int64_t rows = g.groups.sizes[g.groups.offset + j];
    if (rows > 0) {
      busy.push_back({j, row, rows});
      cost += panels * std::max<int64_t>(rows, 16);
      ends.push_back(cost);
    }
    row += rows;
  }
  const size_t elem = dtype_size(g.in_type);
  const auto* a = static_cast<const char*>(g.a);
  const auto* b = static_cast<const char*>(g.b);
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), threads = omp_get_num_threads();
    // This thread's units: those whose cost starts in [cost * t, cost * (t + 1)) / threads.
    const int64_t lo = cost * t / threads, hi = cost * (t + 1) / threads;
    alignas(64) packed::Tile tile;
    int64_t start = 0;
    for (size_t i = 0; i < busy.size(); ++i) {
      const Group& gr = busy[i];
      const int64_t unit = (ends[i] - start) / panels;  // each of its panels' cost
      // Its panels [p0, p1) start in [lo, hi).
      const int64_t p0 = std::clamp<int64_t>((lo - start + unit - 1) / unit, 0, panels);
      const int64_t p1 = std::clamp<int64_t>((hi - start + unit - 1) / unit, 0, panels);
      start = ends[i];
      // Its chunks' columns (the whole panel, or each half in turn) and rows.
      const bool halves = kHalves && !f32 && !pairs && gr.rows >= kHalvesFrom;
      const int64_t width = halves ? packed::kPanel / 2 : packed::kPanel;
      const int most = pairs    ? packed::kPairRows
                       : f32    ? kFloatRows
                       : halves ? kHalfWideRows
                                : kPanelRows;
      // The panel in blocks where its chunks read it more than once and L2 does not hold two
      // panels (the one read and the next, prefetched): past 4 blocks.
      const bool blocked = (halves || gr.rows > most) && steps > 4 * most_block;
      const int64_t block = blocked ? most_block : steps;
      const int64_t blocks = (steps + block - 1) / block;
      const int64_t bands = (gr.rows + packed::kBandRows - 1) / packed::kBandRows;
      for (int64_t p = p0; p < p1; ++p) {
        const char* panel = b + (gr.j * g.b_batch + p * g.b_s0) * elem;
        for (int64_t band = 0; band < bands; ++band) {
          const int64_t b0 = gr.rows * band / bands, b1 = gr.rows * (band + 1) / bands;
          const int64_t chunks = (b1 - b0 + most - 1) / most;
          const int64_t units = packed::kPanel / width * chunks;
          for (int64_t blk = 0; blk < blocks; ++blk) {
            const int64_t s0 = blk * block, s1 = std::min(s0 + block, steps);
            const int64_t k0 = s0 * step_k, kc = std::min(s1 * step_k, g.kc) - k0;
            // The steps its units prefetch: the panel's next block; its first again for the next
            // band (where it has several); or the next panel's first.
            const char* next = nullptr;
            if (s1 < steps) {
              next = panel + s1 * packed::kPanel * sizeof(float);
            } else if (band + 1 < bands) {
              if (blocks > 1) next = panel;
            } else if (p + 1 < p1) {
              next = panel + g.b_s0 * elem;
            }
            const int64_t next_lines = 2 * (s1 < steps ? std::min(block, steps - s1) : block);
            // Each unit's share of them, a line every 2^shift of its steps.
            const int64_t share = (next_lines + units - 1) / units;
            int shift = 0;
            while (share << (shift + 1) <= s1 - s0) ++shift;
            for (int64_t u = 0; u < units; ++u) {
              const int64_t c = u % chunks, col = p * packed::kPanel + u / chunks * width;
              const int64_t cols = std::min(width, g.n - col);
              if (cols <= 0) break;  // the last panel's padding
              const int64_t r0 = b0 + (b1 - b0) * c / chunks,
                            r1 = b0 + (b1 - b0) * (c + 1) / chunks;
              const int rows = static_cast<int>(r1 - r0);
              const char* ar = a + ((gr.row + r0) * g.lda + k0) * elem;
              // Unit u prefetches lines [u, u + 1) times the share of the next.
              packed::Ahead ahead;
              if (units > 1 && next != nullptr) {
                const int64_t first = std::min(next_lines, u * share);
                ahead = {next + 64 * first, std::min(share, next_lines - first), shift};
              }
              // The chunk's first column in the block's first step: one word (an f32, or a bf16
              // pair) a column; its sums in the tile from the same column.
              const int64_t at_col = col - p * packed::kPanel;
              const char* at = panel + (s0 * packed::kPanel + at_col) * sizeof(float);
              float* sums = tile[r0 - b0] + at_col;
              const bool resume = blk > 0;
              if (pairs) {
                packed::pairs_panel(rows, reinterpret_cast<const uint16_t*>(ar), g.lda, kc,
                                    reinterpret_cast<const uint32_t*>(at), sums, resume, ahead);
              } else if (f32) {
                FloatChunk(rows, ar, g.lda, kc, at, sums, resume, ahead);
              } else if (halves) {
                if constexpr (kHalves) {
                  WideChunk<kHalfVecs, kHalfWideRows>(rows, ar, g.lda, kc, at, sums, resume, ahead);
                }
              } else {
                WideChunk<kVecs, kPanelRows>(rows, ar, g.lda, kc, at, sums, resume, ahead);
              }
              if (s1 == steps) packed::store_tile(g, sums, rows, gr.row + r0, col, cols);
            }
          }
        }
      }
    }
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace moekit::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moekit::detail {
namespace packed {

namespace {
std::atomic<int> pairs_for_test{-1};
}  // namespace

bool runs_pairs() {
  const int forced = pairs_for_test.load();
  return forced >= 0 ? forced == 1 && stream::has_avx512_bf16() : stream::has_avx512_bf16();
}

namespace {
template <int R>
MOEKIT_AVX512_BF16 void pairs_kernel(const uint16_t* a, int64_t lda, int64_t kc,
                                     const uint32_t* panel, float* sums, bool resume, Ahead ahead) {
  __m512 s[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    s[r][0] = resume ? _mm512_loadu_ps(sums + r * kPanel) : _mm512_setzero_ps();
    s[r][1] = resume ? _mm512_loadu_ps(sums + r * kPanel + 16) : _mm512_setzero_ps();
  }
  auto step = [&](int64_t kp, bool last_odd) MOEKIT_AVX512_BF16 {
    prefetch_step(ahead, kp);
    const __m512i v0 = _mm512_loadu_si512(panel + kp * kPanel);
    const __m512i v1 = _mm512_loadu_si512(panel + kp * kPanel + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      // The pair (A[r][2kp], A[r][2kp + 1]), or A[r][2kp] alone past A's last element.
      int32_t w;
      if (last_odd) {
        w = a[r * lda + 2 * kp];
      } else {
        std::memcpy(&w, a + r * lda + 2 * kp, sizeof(w));
      }
      const __m512bh av = (__m512bh)_mm512_set1_epi32(w);
      s[r][0] = _mm512_dpbf16_ps(s[r][0], av, (__m512bh)v0);
      s[r][1] = _mm512_dpbf16_ps(s[r][1], av, (__m512bh)v1);
    }
  };
  const int64_t full = kc / 2;
  for (int64_t kp = 0; kp < full; ++kp) step(kp, false);
  if (kc % 2 != 0) step(full, true);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    // Lane i of the pair vectors is column i (v0) and 16 + i (v1): the panel's own order.
    _mm512_storeu_ps(sums + r * kPanel, s[r][0]);
    _mm512_storeu_ps(sums + r * kPanel + 16, s[r][1]);
  }
}
}  // namespace

void pairs_panel(int rows, const uint16_t* a, int64_t lda, int64_t kc, const uint32_t* panel,
                 float* sums, bool resume, Ahead ahead) {
  with_rows<kPairRows>(rows,
                       [&]<int R>() { pairs_kernel<R>(a, lda, kc, panel, sums, resume, ahead); });
}

namespace {
std::atomic<int64_t> block_steps_for_test{0};  // set_packed_block_steps_for_test; 0: the machine's
}  // namespace

int64_t block_steps() {
  if (const int64_t steps = block_steps_for_test.load(); steps > 0) return steps;
  static const int64_t machine = packed_block_steps(sysconf(_SC_LEVEL2_CACHE_SIZE));
  return machine;
}

}  // namespace packed

HWY_EXPORT(RunPacked);

void row_grouped_gemm_packed(const RowGroupedGemm& g) { HWY_DYNAMIC_DISPATCH(RunPacked)(g); }
void set_packed_pairs_for_test(int mode) { packed::pairs_for_test = mode; }

int64_t packed_block_steps(int64_t l2_bytes) {
  const int64_t l2 = l2_bytes > 0 ? l2_bytes : int64_t{512} << 10;
  return std::max<int64_t>(l2 / 8 / (packed::kPanel * sizeof(float)), 64);
}
void set_packed_block_steps_for_test(int64_t steps) { packed::block_steps_for_test = steps; }

}  // namespace moekit::detail
#endif  // HWY_ONCE
