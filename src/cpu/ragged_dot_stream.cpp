// ragged_dot's forward and input gradient for few rows per group (issue 35): each group's weights
// are read from memory once, front to back, while every row of the group accumulates its products
// in registers. oneDNN runs a matmul call per group, packs the weights for it and picks small-M
// paths that leave much of the memory's rate unused between 2 and a few dozen rows per group; here
// the weights are read in the order they are stored, as they are stored.
//
// Two forms, by which dimension of the weights is contiguous:
//   - the contraction's (the input gradient against [K, n] weights, the forward against
//     transposed ones): an output column is a dot product of a row with one weight row. The
//     weight rows go by super-blocks of about kBlockBytes; each chunk of rows runs over a whole
//     super-block, 4 weight rows at a time (the first chunk from memory, the others from L2,
//     their rows staying in L1), the sums reduced across lanes at the end; the next super-block
//     is prefetched in order as they go. With several chunks and rows past kSpanBytes, on
//     AVX-512, the contraction goes in spans, outermost, so that a span of the group's rows stays
//     in L2 (on AVX2 whole rows ran faster: DotItem says why).
//     With more than kSumsRows rows, the output-contiguous form's kernels instead, on panels of
//     transposed weights (TransposedItem): with the bf16-pair kernels, where the contraction is
//     longer than kSpanBytes, a block of 64 weight rows' pairs (a pair is one 32-bit element); on
//     AVX2 (the f32 kernels), 32 weight rows as f32.
//   - the output's (the forward against [K, n], the input gradient against transposed weights):
//     a row's output is a sum of weight rows scaled by its elements. The weights go by blocks of
//     contraction rows. With one chunk of rows (up to 11, or 12 for the f32 kernel), blocks of 8
//     or 16 rows (the pair kernels from 3 rows on: about kBlockBytes), one kernel call walking all
//     their panels; with 2 to kChunkMajorMost chunks (the f32 kernels on AVX2), blocks of 32-48
//     rows, each chunk in turn walking all their panels in one call; with more, blocks of about
//     kBlockBytes and at least kMinBlockRows rows, a panel of output columns at a time, each chunk
//     of rows adding the block's products to its f32 sums (kept in a per-thread buffer between
//     blocks); either way the next block is prefetched in order as the panels run. With several
//     chunks and rows past kSpanBytes (kWholeRowBytes on AVX2), or many rows and sums past
//     kSumsBytes, an item takes a slab of the columns. (A panel's 128 bytes of every row read
//     straight from memory, a strided walk, ran at ~70% of a sequential read's rate on an AMD EPYC:
//     bench/results/ragged_dot_small-cpu-2026-11-25/by-hand/.)
// A work item is a group (up to kItemRows of its rows), a slab of its output columns, or (the
// output's form, one chunk of rows, fewer groups than threads) a part of its contraction, whose
// sums the threads add when every part is done (stream::items and one_chunk_split say when).
// Each thread takes a contiguous run of items of near-equal cost (their weight bytes, weighted up
// where their rows make them compute-bound), so that each item can prefetch the start of the next.
//
// Two kernels: on a CPU with AVX512-BF16, bf16 inputs multiply as bf16 pairs (vdpbf16ps; in the
// output-contiguous form the pairs are two consecutive weight rows interleaved as the first chunk
// reads them, and kept so for the chunks after it); everywhere else f32 FMA through Highway (bf16
// widened to f32). Highway 1.0 (Debian 12) has no bf16 dot product, so the pair kernels are
// written with intrinsics for the one target and chosen at run time. On such a CPU with AMX (an
// Intel Xeon), the output-contiguous form's groups of one chunk of rows take the even/odd kernels
// instead: each weight row's bf16 columns widened to f32 as they lie (the even ones by a shift,
// the odd ones by a mask) and FMA'd, with no interleave of two rows (axpy_even_odd_panels says
// why). Sums are f32; a bf16 output is rounded once. (vdpbf16ps treats denormal inputs as zero and
// flushes denormal results, as oneDNN's bf16 matmul on the same instruction does: values below
// 1e-38 that no model's weights or activations hold.) One of the weights' two dimensions is always
// contiguous (check_view asks a unit innermost stride of rhs), so the two forms cover every call.
// The small loops over a kernel's rows and vectors carry `#pragma GCC unroll`: without it GCC 12
// kept the sums in a stack array, stored every step (a third of the speed).
//
// A row's result does not depend on the other rows, the chunk it falls in or the thread count,
// but oneDNN's does, so kAuto never takes this path in the batch-invariant mode (asked for by name,
// it keeps its own bits).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/ragged_dot_stream.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Must come after foreach_target.h.
#include <hwy/aligned_allocator.h>
#include <hwy/highway.h>
#include <immintrin.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "check.h"
#include "cpu/convert.h"
#include "cpu/grouped_gemm.h"
#include "cpu/lanes-inl.h"
#include "cpu/stream.h"
#include "cpu/transpose16.h"

#ifndef MOEKIT_RAGGED_DOT_STREAM_DECL
#define MOEKIT_RAGGED_DOT_STREAM_DECL
namespace moekit::detail::stream {

// The pair kernels' shapes: rows per chunk (their sums take 24 of the 32 AVX-512 registers),
// output columns per panel (4 vectors of 16).
constexpr int kAxpyRows = 6, kPanel = 64;
// axpy_pairs_panels (one chunk of rows): up to kAxpyPanelsWideRows rows with panels of 4 vectors,
// up to kAxpyPanelsRows with panels of 2. In L1 (by hand, a block of 64 weight rows), 6 rows of 4
// vectors ran at 377 GFLOP/s against 468 with 5 (GCC 12 spills around the 24 sums), 6 rows of 2
// at 427, 7-11 rows of 2 at 461-483, 12 rows of 2 at 405. (With more than one chunk, rows of 5
// instead of 6 ran no faster: the first chunk's strided read of a block bounds those.)
constexpr int kAxpyPanelsWideRows = 5, kAxpyPanelsRows = 11;
// Weight rows per block of the output-contiguous form, and bytes per super-block of the
// contraction-contiguous one (AxpyItem, DotItem say why).
constexpr int64_t kBlockBytes = 128 << 10, kMinBlockRows = 64, kOneChunkBlockRows = 8;
// The pair kernels' groups of one chunk of at least this many rows take blocks of at least
// kBlockBytes (detail::one_chunk_pair_block_rows says why).
constexpr int64_t kPairLongBlockRows = 3;
// The f32 kernels' groups of 1-2 rows whose sums take at most this many bytes run row-major
// (detail::one_chunk_row_major; AxpyRowMajor says why).
constexpr int64_t kRowMajorSumsBytes = 6 << 10;
// The most bytes of a weight row that one item (output-contiguous form) or one kernel call
// (contraction-contiguous form, AVX-512) takes: wider rows go in slabs or spans, so that a block's
// rows stay in L2 and a chunk's rows in L1 (6 rows of the chunk and 4 weight rows of 4 KiB fill 40
// of L1's 48 KiB). 8 KiB let gpt-oss-20b's 5.6 KiB and mixtral-8x7b's 7 KiB spans push a chunk's
// rows out of L1: their input gradient at 64-512 tokens ran 1.2-1.3x slower than with 4 KiB;
// 3 KiB split deepseek-v3's 4 KiB rows, to its loss (an AMD EPYC with AVX-512 BF16; on AVX2 the
// dot products take whole rows: DotItem says why).
constexpr int64_t kSpanBytes = 4096;
// The most output columns of an item of the contraction-contiguous form (its buffer of sums).
constexpr int64_t kDotItemCols = 2048;
// The most rows of a group in one work item (bounding its per-thread buffers of sums).
constexpr int64_t kItemRows = 192;
// The output-contiguous form, items of more than kSumsRows rows: the slab of columns is narrowed
// until the item's f32 sums take at most kSumsBytes. A block keeps about kBlockBytes, so a
// narrower slab's blocks span more contraction rows and each chunk loads and stores its sums once
// per more of them (at 64 rows and 2048 columns, 256 rows a block instead of 64); the sums and
// both blocks also stay well inside L2 (the sums alone took 512 KiB there). With fewer rows the
// call is closer to the memory's rate, and the slabs' shorter runs of each weight row cost more
// than they save. By hand (deepseek-v3's forward, K 7168, n 2048, every group the same size,
// weights cold): 64 KiB against unbounded sums ran 0.77 / 0.85 / 0.94x at 16 / 24 / 32 rows,
// 1.18 / 1.13 / 1.16 / 1.21x at 36 / 40 / 64 / 96; 128 KiB 0.87 / 0.96 / 0.96x 64 KiB's rate at
// 40 / 64 / 96 rows (ragged_dot_small-cpu-2026-11-26-7/README.md). The contraction-contiguous
// form's items of more than kSumsRows rows with a contraction longer than kSpanBytes run the same
// kernels on transposed pairs, and take the same slabs: against the dot products (in spans),
// gpt-oss-20b's input gradient (5.6 KiB) ran 1.05 / 1.11 / 1.13x at 64 / 128 / 256 rows per group,
// mixtral-8x7b's (28 KiB) 1.11 / 1.18x at 64 / 128; with one span (deepseek-v3's 4 KiB, qwen3's
// 1.5 KiB) 0.88-1.03x, so not there (by-hand/dlhs-dot-vs-transposed.txt).
constexpr int64_t kSumsRows = 32;
constexpr int64_t kSumsBytes = 64 << 10;
// The output-contiguous form, bf16, groups of one chunk of rows on weight rows longer than
// kWideRowBytes: slabs of columns whose f32 sums take at most wide_sums_bytes(), a quarter of a
// core's L2 (wide_sums_budget). Whole, a block of such rows (16 of mixtral-8x7b's 56 KiB gate|up
// rows: 896 KiB) and the next one, prefetched as it runs, do not fit L2 beside the sums (917 KB at
// 8 rows): the block's loads waited on memory (a perf profile put a third of the kernel's samples
// on them). On an AMD EPYC with 512 KiB of L2, A/B in one loop, [4096, 28672] weights, 8 groups
// routed from T tokens, k = 2 (bench/results/ragged_dot_small-cpu-2026-11-26-9/, geometric means
// of 9 runs): 128 KiB of sums 0.99 / 1.05 / 1.04 / 1.08 / 1.19x at T = 2 / 4 / 8 / 16 / 32 (at
// first 256 KiB 1.04-1.24x, 512 KiB 1.02-1.11x); on 28 KiB rows ([4096, 14336]) the same cut ran
// 0.97-1.05x, so not there. On an Intel Xeon with 2 MiB of L2, 512 KiB against 128 KiB in one
// loop, twice (bench/results/ragged_dot_small-cpu-2026-11-28-4/wide-sums.txt), share of the floor
// at 8 / 16 / 24 tokens: rows spread evenly 85 / 73-75 / 69-76% -> 92-95 / 83-89 / 73-74%,
// unevenly (--imbalance 0.99) 80-85 / 75-76 / 77-78% -> 83-86 / 79-80 / 78-83%.
constexpr int64_t kWideRowBytes = 32 << 10;
constexpr int64_t kMinWideSumsBytes = 128 << 10, kMaxWideSumsBytes = 1 << 20;
int64_t wide_sums_bytes();                        // this machine's wide_sums_budget, or the test's
int64_t one_chunk_block_rows(int64_t row_bytes);  // this machine's (one_chunk_block_rows below)
int64_t one_chunk_pair_block_rows(int64_t rows, int64_t row_bytes);  // this machine's

// A group's rows [row, row + rows) and output columns [col, col + cols), over the contraction's
// rows [k0, k1). partial >= 0: the item is one of several parts of its group's contraction, whose
// f32 sums go to the call's buffer of parts at that offset ([rows][cols rounded up to panels]) for
// RunItems to add; else -1, the item's sums go to the output. (Only the output-contiguous form's
// groups of one chunk are split so; the other items take the whole contraction.)
struct Item {
  int64_t j, row, rows, col, cols, k0, k1, partial;
};

// The output-contiguous form's groups of one chunk of rows (calls near the memory's rate;
// one_chunk_split in grouped_gemm.h). A column slab reads a run of each weight row, and runs of a
// few KiB read slower than whole rows; a part of the contraction reads whole rows. So where the
// groups are fewer than the threads each is cut into parts of the contraction (of kMinPartRows rows
// at least), and where the threads do not divide their count, into column slabs where the runs
// keep kLongRunBytes; else a group is whole. By hand (two threads, one row per group, K 2048, bf16,
// weights cold; share of a parallel read's rate in the same loop;
// bench/results/ragged_dot_small-cpu-2026-11-26-8/by-hand/slabs.txt): one group of 1408 columns
// whole / in 2 / 8 slabs 67 / 61 / 37%, of 4096 columns 37 / 68 / 58%, of 16384 42 / 79 / 71%; 2
// groups whole 65-80%, in 2 slabs 45-71%; 3 groups of 1408 or 2880 columns whole 50-61%, in 2
// slabs 42-53%, of 8192 or 14336 columns whole 58-69%, in 2 slabs 70-75%. (Before, groups fewer
// than 4 per thread were cut into slabs until there were 4: at 1 token the forward of
// deepseek-v2-lite, gpt-oss-20b and mixtral-8x7b ran at 68-81% of the floor, whole at 87-115%;
// -8/ab-slabs.txt.) A lone group in two parts: -8/by-hand/parts.txt.
constexpr int64_t kLongRunBytes = 8192, kMinPartRows = 64;

// The output-contiguous form, groups of several chunks of rows, below AVX-512 (the f32 kernels;
// measured on AVX2): weight rows of up to kWholeRowBytes go whole, longer ones in slabs of at most
// kSpanBytes (on AVX-512, slabs past kSpanBytes). A/B in one loop, weights cold (AMD EPYC family 23
// model 49, bench/results/ragged_dot_small-cpu-2026-11-27-4/ab-slabs*.txt), whole against slabs at
// 8 / 16 / 32 rows a group: gpt-oss-20b's forward (5.6 KiB rows) 1.31 / 1.13 / 1.04x,
// deepseek-v2-lite's gate|up (5.5 KiB) 1.25 / 1.09 / 1.02x, its forward of F columns in f32 (5.5
// KiB) 1.22 / 1.09 / 1.04x; mixtral-8x7b's down (8 KiB) 1.08 / 0.97 / 0.93x, its forward of F
// columns (28 KiB) in slabs of 8 KiB 1.01 / 0.98 / 0.94x.
constexpr int64_t kWholeRowBytes = 6 << 10;

// The items of a call: each group with rows, in runs of at most kItemRows rows, whole or in slabs
// of whole panels: in the output-contiguous form, groups of one chunk of `chunk` rows as
// one_chunk_split says (in slabs, or in parts of the contraction); other groups where they are
// too few for 4 items per thread, or (the output-contiguous form) rows of more than
// `whole_row_bytes` (in slabs of at most kSpanBytes) or (more than kSumsRows rows) sums of more
// than kSumsBytes; `transposed`: the contraction-contiguous form's items of more than kSumsRows
// rows run TransposedItem, and are bounded by their sums too. A group's parts are consecutive
// items.
std::vector<Item> items(const RowGroupedGemm& g, int64_t panel, int64_t chunk, bool transposed,
                        int64_t whole_row_bytes);

// Whether a call is of the contraction-contiguous form with bf16 rows longer than kSpanBytes
// (where the pair kernels' dot products go in spans, their sums added span by span): with the pair
// kernels, its items of more than kSumsRows rows run on transposed pairs.
inline bool long_dot(const RowGroupedGemm& g) {
  return g.b_s1 != 1 && g.in_type == DType::kBF16 && g.kc * 2 > kSpanBytes;
}

// Thread t of `threads`' items [begin, end): contiguous runs of near-equal cost, an item's cost
// its weight bytes, times its rows over kComputeRows where the rows make it compute-bound
// (roughly where a row's products take as long as its weights' read on the machines measured).
constexpr int64_t kComputeRows = 16;
std::pair<int64_t, int64_t> share(const std::vector<Item>& items, int t, int threads);

// Lines of a region to prefetch: rows of `row_lines` cache lines from base, `stride` bytes apart;
// of those, in row order, the lines [first, last); into L1 (into_l1) or L2.
struct Lines {
  const char* base = nullptr;
  int64_t stride = 0, row_lines = 0, first = 0, last = 0;
  bool into_l1 = false;
};

// Whether a block of `block_bytes` goes into L1 as it is prefetched on this machine
// (detail::prefetch_into_l1), or into L2.
bool prefetch_into_l1(int64_t block_bytes);
bool dot_chunk_fits_l1(int64_t chunk_bytes);  // this machine's (detail::dot_chunk_fits_l1)

// The lines of `rows` rows of `row_bytes` bytes, `stride` bytes apart, from p (where the rows do
// not all start at the same place in a line, one more line per row).
inline Lines lines_of(const void* p, int64_t stride, int64_t row_bytes, int64_t rows) {
  const auto offset = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) % 64);
  const bool aligned = stride % 64 == 0;
  const int64_t row_lines = aligned ? (offset + row_bytes + 63) / 64 : (row_bytes + 63) / 64 + 1;
  return {static_cast<const char*>(p) - (aligned ? offset : 0), stride, row_lines, 0,
          std::max<int64_t>(rows, 0) * row_lines};
}

// Of `all`, the lines of call `call` when they are spread over `calls` calls, in order. (Split by
// whole rows, as before, a block of fewer rows than calls put every prefetch in its first calls and
// none in the rest: 64 rows of 4 KiB over the 128 calls of 6 + 2 rows on 64 panels, or a dot
// product's super-block of 84 weight rows over 11 chunks x 21 calls. A/B of builds in turn,
// bench/results/ragged_dot_small-cpu-2026-11-27-3/: qwen3-30b-a3b's forward at 8 / 16 rows a group
// 1.04-1.09x, its input gradient at 16 / 32 rows 1.02-1.04 / 1.07x.)
inline Lines part(Lines all, int64_t call, int64_t calls) {
  const int64_t n = all.last - all.first;
  const int64_t first = all.first + n * call / calls;
  all.last = all.first + n * (call + 1) / calls;
  all.first = first;
  return all;
}

// Prefetches a call's lines (into L1 or L2, as they say) over `steps` steps of its loop, in
// order: per step, as many as there are lines per step, rounded up, so that fewer lines than steps
// go one a step from the first step; or (kSpread) fewer lines than steps one every steps / lines
// steps, at about the rate the memory brings them. In bursts of one a step a core's misses in
// flight filled up and the loads of the block at hand, from L2, waited behind them: the weights'
// read and the FMAs took about the sum of their times, not the larger. By hand (AMD EPYC family 23
// model 49, two cores, the forward's 6 + 2 rows of sums on 16 columns a step): read alone ~17.5 ms,
// FMAs alone 21.8, together 36.1 in bursts, 27.4 with one line every 4 steps (bench/results/
// ragged_dot_small-cpu-2026-11-27-2/by-hand/). Spread: the dot products (DotF32, DotSplit) and
// the f32 axpy kernels (AxpyF32); the pair kernels (AVX512-BF16, not measured spread) keep the
// bursts.
template <bool kSpread = false>
class Ahead {
 public:
  Ahead(const Lines& l, int64_t steps)
      : row_(l.base + (l.row_lines > 0 ? l.first / l.row_lines * l.stride : 0)),
        line_(l.row_lines > 0 ? l.first % l.row_lines : 0),
        row_lines_(l.row_lines),
        stride_(l.stride),
        left_(std::max<int64_t>(l.last - l.first, 0)),
        per_(steps > 0 ? (left_ + steps - 1) / steps : left_),
        every_(kSpread && left_ > 0 && steps > left_ ? steps / left_ : 1),
        count_(every_),
        into_l1_(l.into_l1) {}
  void step() {
    if constexpr (kSpread) {
      if (--count_ > 0) return;
      count_ = every_;
    }
    for (int64_t i = 0; i < per_ && left_ > 0; ++i, --left_) {
      if (into_l1_) {
        prefetch_line<true>(row_ + line_ * 64);
      } else {
        prefetch_line<false>(row_ + line_ * 64);
      }
      if (++line_ == row_lines_) line_ = 0, row_ += stride_;
    }
  }

 private:
  const char* row_;
  int64_t line_, row_lines_, stride_, left_, per_, every_, count_;
  bool into_l1_;
};

// Rows [0, rows) in the fewest chunks of at most `most`, of near-equal sizes (a last chunk of
// 1 or 2 rows would run a kernel at a fraction of its rate), or (full_first) chunks of `most` and a
// last one of what is left: chunk i is [begin(i), begin(i + 1)).
struct Chunks {
  Chunks(int64_t rows, int64_t most, bool full_first = false)
      : rows(rows), count((rows + most - 1) / most), most(most), full_first(full_first) {}
  int64_t begin(int64_t i) const {
    return full_first ? std::min(i * most, rows) : rows * i / count;
  }
  int size(int64_t i) const { return static_cast<int>(begin(i + 1) - begin(i)); }
  int64_t rows, count, most;
  bool full_first;
};

// The contraction-contiguous form's dot-product kernel for an item of `rows` rows: rows per chunk
// and weight rows per call (each a column of the output). Each chunk reads the item's super-block
// of weights again, from L2, while the next super-block streams in from memory; a chunk more costs
// far more than its share of the compute where the two take about the same time. So the fewest
// chunks whose kernel still keeps the FMA units busy: up to 8 rows one chunk against 1 weight row,
// up to 16 two chunks against 2, more in chunks of 6 against 4 (24 sums in registers; 8 x 2 and
// 12 x 2 ran slower there). A/B in one loop, bf16, qwen3-30b-a3b's input gradient (K 2048 out, n
// 768 contracted), weights cold, rows spread evenly, share of the floor
// (bench/results/ragged_dot_small-cpu-2026-11-26-10/): 4 / 8 / 16 rows a group 82 / 84 / 70% with
// 6 x 4 everywhere, 102 / 96 / 84% so; 24-128 rows level. By hand, one stream of weights beside
// dot products of 18 rows in registers ran at the read's rate when each line was used in one pass,
// 1.2x / 1.75x slower in 2 / 3 passes (by-hand/overlap.txt, chunks.txt).
struct DotShape {
  int rows, cols;
};
// Chunks of 6 rows against 4 weight rows: past 16 rows, and where a chunk of the other shapes
// would not stay in L1 (DotItem says why).
constexpr DotShape kDotWide{6, 4};
constexpr DotShape dot_shape(int64_t rows) {
  return rows <= 8 ? DotShape{8, 1} : rows <= 16 ? DotShape{8, 2} : kDotWide;
}
// The most sums a dot-product call returns (rows x cols of any shape above).
constexpr int kDotMostSums = 24;

// The pair kernels (defined once, for AVX512-BF16), on bf16 bits.
// acc[r][0, 64) += sum over the block's kc contraction rows of A[r][k] * B[k][0, 64) for
// r < rows <= kAxpyRows: B's rows ldb apart, 64 columns of which the first `cols` exist; acc in
// the panel's pair order (pair_order_to_columns), rows ld_acc apart.
// The lines `ahead` names are prefetched as the kernel goes. The weights come from b and are
// left interleaved in `panel` (kWrite: [ceil(kc / 2)][64] pairs, 64-byte aligned), or from that
// panel (kRead). (One chunk of rows goes through axpy_pairs_panels.)
enum class PanelUse { kWrite, kRead };
void axpy_pairs(int rows, const uint16_t* a, int64_t lda, int64_t kc, const uint16_t* b,
                int64_t ldb, int64_t cols, float* acc, int64_t ld_acc, const Lines& ahead,
                uint32_t* panel, PanelUse use);
// axpy_pairs straight from b (no panel) over every panel of `cols` columns: B's columns [64p, 64p +
// 64) into acc[r][64p, 64p + 64), in one call, for rows <= kAxpyPanelsRows (past
// kAxpyPanelsWideRows, by halves of panels: the same pair order).
void axpy_pairs_panels(int rows, const uint16_t* a, int64_t lda, int64_t kc, const uint16_t* b,
                       int64_t ldb, int64_t cols, float* acc, int64_t ld_acc, const Lines& ahead);
// The pairs of kc contraction elements of 64 weight rows (those of the contraction-contiguous
// form), as axpy_pairs' panel in column order: panel[kp][c] = (w[c][2kp], w[c][2kp + 1]) for
// kp < ceil(kc / 2), c < 64; weight rows ldw apart, of which the first `rows` exist (the rest
// give 0); an odd kc's last pair is (w[c][kc - 1], 0). Each pair is one 32-bit element, so this is
// a 32-bit transpose, 16 x 16 at a time.
void transpose_pairs(const uint16_t* w, int64_t ldw, int64_t kc, int64_t rows, uint32_t* panel);
// tile[r][0, 64) in column order from acc[r][0, 64) in the pair order (tile may be acc).
void pair_order_to_columns(int rows, const float* acc, int64_t ld_acc, float* tile,
                           int64_t ld_tile);
// The even/odd kernels (one chunk of rows, bf16 weights, on a CPU with AVX512-BF16 where
// even_odd_one_chunk says so): axpy_pairs_panels' contract, but each weight row's 32-bit lanes
// (two bf16 columns) widened to f32 as they lie, the even column by a shift and the odd one by a
// mask, and multiplied by A's rows as f32 (af, rows ld_af apart) with FMAs: no interleave of two
// weight rows, twice the multiplies (exact f32 products; no denormal flushed). acc in the
// even/odd order (even_odd_to_columns): per 32 columns, a vector of the even ones, then one of the
// odd ones. By hand on an Intel Xeon (AMX; one row a group, qwen3-30b-a3b's forward, weights cold,
// no prefetch), share of a 4-stream read: the pair kernel's work 52-56%, the even/odd kernel's
// 65-69%, the pairs without their interleave (wrong sums) 71-73%, loads alone 72-91% (it moved
// between builds of the same loop). A/B on the same Xeon
// (bench/results/ragged_dot_small-cpu-2026-11-28-8/): qwen3-30b-a3b's forward (1.5 KiB rows) at
// 1-32 tokens 1.01-1.12x (78-85% of the floor, from 71-79%), mixtral-8x7b's (28 KiB rows) at 4-24
// tokens 1.04-1.14x and its layer at 1 token 1.07x; deepseek-v3's forward (4 KiB rows),
// qwen3-30b-a3b's layer (3-4 KiB rows) and its input gradient on [E, n, K] level. The AMD EPYC
// (AVX512-BF16, no AMX) keeps the pair kernels it was measured on.
void axpy_even_odd_panels(int rows, const float* af, int64_t ld_af, int64_t kc, const uint16_t* b,
                          int64_t ldb, int64_t cols, float* acc, int64_t ld_acc,
                          const Lines& ahead);
// tile[r][0, 64) in column order from acc[r][0, 64) in the even/odd order (tile may be acc).
void even_odd_to_columns(int rows, const float* acc, int64_t ld_acc, float* tile, int64_t ld_tile);
// Whether one chunk of rows on bf16 weights takes the even/odd kernels rather than the pair
// kernels (AVX512-BF16 CPUs): on a CPU with AMX (an Intel Xeon, Sapphire Rapids or later), where
// they were measured faster; set_even_odd_for_test overrides.
bool even_odd_one_chunk();
// out[r][c] = sum_k A[r][k] * B[c][k] for r < rows, c < shape.cols, rows <= shape.rows (a shape
// dot_shape gives; B's rows ldb apart, contiguous along k), out's rows ld_out apart; `ahead`
// prefetched as it goes.
void dot_pairs(DotShape shape, int rows, const uint16_t* a, int64_t lda, int64_t kc,
               const uint16_t* b, int64_t ldb, float* out, int64_t ld_out, const Lines& ahead);

}  // namespace moekit::detail::stream
#endif

HWY_BEFORE_NAMESPACE();
namespace moekit::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using stream::Item;

// Rows per chunk of the f32 kernels: their sums fill at most 24 of the registers (16 on AVX2).
constexpr int kF32Rows = HWY_TARGET <= HWY_AVX3 ? 6 : 3;
// The f32 axpy kernel's rows per chunk, with several chunks (the output-contiguous form): kF32Rows
// on panels of 4 vectors, or, on AVX2, 2 kF32Rows on two panels of 2 vectors side by side. There
// bf16 weights take a register each for their widened vectors, so 3 rows' 12 sums spilled one (its
// FMA then waited on a store and a load every step): in L1 (by hand, AMD EPYC family 23 model 49,
// one core) 3 rows x 4 vectors ran at 46 GFLOP/s, 4-6 rows x 2 vectors at 104 (the peak ~107). f32
// weights, read by the FMAs from memory, ran 3 x 4 at 107 in L1, but from memory the chunks of 6
// (chunk-major up to kChunkMajorMost chunks, 7-8 rows on 3 vectors, as bf16) and the prefetches
// spread (AxpyF32) ran faster together, though neither alone did: A/B in one loop, weights cold,
// rows spread evenly (AMD EPYC family 23 model 49; bench/results/ragged_dot_small-cpu-2026-11-27-6/
// ab-f32-chunks.txt), qwen3-30b-a3b's forward in f32 at 8 / 12 / 16 / 32 / 48 / 64 rows a group
// 1.02-1.09 / 1.27 / 1.17-1.24 / 1.13 / 1.06 / 1.02x (routed, 16 on average, 1.17x; 1-6 rows
// level), deepseek-v3's shape (32 of its experts) at 8 / 16 / 32 rows 1.08 / 1.30 / 1.19-1.21x,
// qwen3's down shape (K 768, n 2048) 1.10 / 1.28 / 1.21x; at 128 rows 0.96x, past the bound where
// oneDNN takes the call (stream_most_rows). (One chunk of 3 rows stays on 4 vectors: on 2,
// qwen3-30b-a3b's forward at 32-48 tokens ran 1.15x slower.)
constexpr bool kF32NarrowChunks = HWY_TARGET > HWY_AVX3;
// kF32NarrowChunks' items of at most this many chunks go chunk by chunk over each block
// (AxpyItem says why).
constexpr int64_t kChunkMajorMost = 6;
// kF32NarrowChunks' chunks of 3 to kF32QuadRows rows (chunk-major) run on panels of 3 vectors (12
// sums, 3 widened weight vectors and a broadcast row value: the 16 registers), not 2 (6-8 sums,
// fewer than the 10 that the FMA units' latency asks for). Items of 2 kF32Rows + 1 to 2
// kF32QuadRows rows (7 or 8) go so in two chunks, rather than as 2 kF32Rows and the 1 or 2 rows
// left on 4 vectors, whose chunk multiplies 4 widened vectors by 2 rows (by hand, AMD EPYC family
// 23 model 49, a block of 48 weight rows from L2: 8 rows as 4 + 4 at 160 GFLOP/s on two cores, as 6
// + 2 at 144; weights from memory 1.04x); items of 2 kF32Rows j + kF32Rows rows (9, 15, ..., 33) as
// j chunks of 2 kF32Rows and one of kF32Rows, rather than near-equal chunks (9 as 4 + 5, 15 as 5 +
// 5 + 5). A/B in one loop, weights cold, the forward with rows spread evenly
// (bench/results/ragged_dot_small-cpu-2026-11-27-5/ab-fours.txt, ab-threes.txt): qwen3-30b-a3b at
// 7 / 8 / 9 / 15 / 21 / 27 / 33 rows a group 1.05-1.11 / 1.01-1.04 / 1.04-1.06 / 1.07-1.08 /
// 1.03-1.04 / 1.02 / 1.00-1.01x (routed, 8 and 16 on average, 1.01-1.03x), deepseek-v3's shape at
// 8 / 9 / 15 / 21 1.03 / 1.03-1.06 / 1.07-1.08 / 1.04x (routed, 8 on average, 1.00-1.02x),
// mixtral-8x7b's at 8 1.01-1.04x (gate|up) and 1.06x (down). Not taken: every chunk of 4 rows at
// 9-16 rows (0.91-0.93x at 12-16), the 4 rows left of 10, 16, 22, 28 on 3 vectors (0.97-1.03x),
// blocks of 48-64 weight rows for 7-8 (0.95-1.01x).
constexpr int kF32QuadRows = 4;
constexpr int kF32DotRows = HWY_TARGET <= HWY_AVX3 ? 6 : 2;
// The f32 dot products' shape (stream::dot_shape says why the fewest chunks): on AVX-512, up to 4
// rows one chunk against 1 weight row (6 x 4 where those rows do not stay in L1: DotItem), up to 8
// one against 2, more chunks of kF32DotRows against 4;
// A/B in one loop, qwen3-30b-a3b's input gradient in f32, rows spread evenly / routed, share of
// the floor (ragged_dot_small-cpu-2026-11-26-10): 2 rows a group 88 -> 108% / 85 -> 100%, 4 rows
// 89 -> 100% / 88 -> 97%, 8 rows 82 -> 85% / 88 -> 90%; 8 x 2 past 8 rows level or slower. On AVX2
// (16 registers), up to 2 rows against 4 weight rows, more in chunks of 6 against 2: 2 x 4's 8
// sums left the FMAs waiting on their latency (5 cycles, 2 a cycle: 10 sums at least). qwen3's f32
// input gradient, old and new tool in turn, two rounds (AMD EPYC family 23 model 49,
// ragged_dot_small-cpu-2026-11-26-11): 8 / 16 / 32 / 64 rows a group 50.4-52.1 / 80.7-82.2 /
// 146.5-152.5 / 285.7-289.1 ms -> 44.7 / 66.6-69.7 / 119.2-122.3 / 224.9-228.5.
constexpr stream::DotShape DotShapeF32(int64_t rows) {
  if (HWY_TARGET > HWY_AVX3) return rows <= 2 ? stream::DotShape{2, 4} : stream::DotShape{6, 2};
  if (rows > 8) return {kF32DotRows, 4};
  return rows <= 4 ? stream::DotShape{8, 1} : stream::DotShape{8, 2};
}

template <typename T>
HWY_INLINE lanes::V Load(lanes::D d, const T* p, size_t i) {
  return LoadLanes<std::is_same_v<T, uint16_t>>(d, p, i);
}

// acc[r][0, VN) += sum_{k < kc} A[r][k] * B[k][0, VN), A's elements f32 (F32Rows), B's of type
// TB; pf stepped once per k. kWiden: B's rows also stored as f32 in wide[k][0, VN), rows ld_wide
// apart.
template <int R, int V, typename TB, bool kWiden>
HWY_INLINE void AxpyF32Panel(const float* a, int64_t lda, int64_t kc, const TB* b, int64_t ldb,
                             float* acc, int64_t ld_acc, stream::Ahead<true>& pf, float* wide,
                             int64_t ld_wide) {
  const lanes::D d;
  const size_t N = hn::Lanes(d);
  lanes::V s[R][V];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < V; ++i) s[r][i] = hn::LoadU(d, acc + r * ld_acc + i * N);
  for (int64_t k = 0; k < kc; ++k) {
    pf.step();
    const TB* row = b + k * ldb;
    lanes::V bv[V];
#pragma GCC unroll 4
    for (int i = 0; i < V; ++i) bv[i] = Load(d, row, i * N);
    if constexpr (kWiden) {
#pragma GCC unroll 4
      for (int i = 0; i < V; ++i) hn::StoreU(bv[i], d, wide + k * ld_wide + i * N);
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const lanes::V av = hn::Set(d, a[r * lda + k]);
#pragma GCC unroll 4
      for (int i = 0; i < V; ++i) s[r][i] = hn::MulAdd(av, bv[i], s[r][i]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < V; ++i) hn::StoreU(s[r][i], d, acc + r * ld_acc + i * N);
}

// AxpyF32Panel over `panels` panels of VN columns side by side (B's and acc's), in one call;
// kWiden: B's rows also stored as f32 in wide ([kc][panels VN]). The prefetches spread
// (stream::Ahead): A/B against the bursts, builds in turn, qwen3-30b-a3b's forward, weights cold
// (AMD EPYC family 23 model 49; ragged_dot_small-cpu-2026-11-27-2/): bf16 weights 1.25-1.35x at 4
// rows a group, 1.07-1.16x at 8, 1.03-1.08x at 32, 1.04-1.06x at 64; f32 weights (then in chunks
// of 3 rows on 4 vectors) 0.93-1.06x at 4-12 rows, now with the chunks of 6 faster together
// (kF32NarrowChunks).
template <int R, int V, typename TB, bool kWiden = false>
HWY_NOINLINE void AxpyF32(const float* a, int64_t lda, int64_t kc, const TB* b, int64_t ldb,
                          int64_t panels, float* acc, int64_t ld_acc, const stream::Lines& ahead,
                          float* wide = nullptr) {
  const auto width = static_cast<int64_t>(V * hn::Lanes(lanes::D()));
  stream::Ahead<true> pf(ahead, panels * kc);
  for (int64_t p = 0; p < panels; ++p) {
    AxpyF32Panel<R, V, TB, kWiden>(a, lda, kc, b + p * width, ldb, acc + p * width, ld_acc, pf,
                                   wide + p * width, panels * width);
  }
}

// The sum of the lanes of v.
HWY_INLINE float SumLanes(lanes::D d, lanes::V v) { return hn::GetLane(hn::SumOfLanes(d, v)); }

#if HWY_TARGET != HWY_SCALAR
// x's 128-bit blocks added together.
template <class D>
HWY_INLINE hn::Vec<hn::Full128<float>> SumBlocks(D d, hn::Vec<D> x) {
  if constexpr (hn::MaxLanes(d) <= 4) {
    return x;
  } else {
    const hn::Half<D> dh;
    return SumBlocks(dh, hn::Add(hn::LowerHalf(dh, x), hn::UpperHalf(dh, x)));
  }
}
#endif

// out[0, 4) = the lane sums of v[0, 4), together: within each 128-bit block the four vectors'
// lanes interleaved and added pairwise (their partial sums side by side), then the blocks added.
HWY_INLINE void StoreSums4(lanes::D d, const lanes::V (&v)[4], float* out) {
#if HWY_TARGET == HWY_SCALAR
  for (int c = 0; c < 4; ++c) out[c] = SumLanes(d, v[c]);
#else
  const hn::Repartition<uint64_t, lanes::D> d64;
  const lanes::V ab =
      hn::Add(hn::InterleaveLower(d, v[0], v[1]), hn::InterleaveUpper(d, v[0], v[1]));
  const lanes::V cd =
      hn::Add(hn::InterleaveLower(d, v[2], v[3]), hn::InterleaveUpper(d, v[2], v[3]));
  const auto ab64 = hn::BitCast(d64, ab), cd64 = hn::BitCast(d64, cd);
  const lanes::V x = hn::Add(hn::BitCast(d, hn::InterleaveLower(d64, ab64, cd64)),
                             hn::BitCast(d, hn::InterleaveUpper(d64, ab64, cd64)));
  hn::StoreU(SumBlocks(d, x), hn::Full128<float>(), out);
#endif
}

// out[r][c] = the lane sum of s[r][c], rows ld_out apart: 4 at a time (in row-major order), the
// last R C % 4 one by one.
template <int R, int C>
HWY_INLINE void StoreDotSums(lanes::D d, const lanes::V (&s)[R][C], float* out, int64_t ld_out) {
  if constexpr (C == 4) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) StoreSums4(d, s[r], out + r * ld_out);
  } else {
    constexpr int kSums = R * C;
    float four[4];
#pragma GCC unroll 8
    for (int i = 0; i + 4 <= kSums; i += 4) {
      const lanes::V v[4] = {s[i / C][i % C], s[(i + 1) / C][(i + 1) % C],
                             s[(i + 2) / C][(i + 2) % C], s[(i + 3) / C][(i + 3) % C]};
      StoreSums4(d, v, four);
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) out[(i + q) / C * ld_out + (i + q) % C] = four[q];
    }
#pragma GCC unroll 4
    for (int i = kSums / 4 * 4; i < kSums; ++i)
      out[i / C * ld_out + i % C] = SumLanes(d, s[i / C][i % C]);
  }
}

#if HWY_TARGET != HWY_SCALAR
// The 2N bf16 at p as f32: the even-indexed ones (each 32-bit lane's low half, shifted up) and
// the odd-indexed ones (its high half, shifted down and up: no mask to hold in a register).
HWY_INLINE void SplitBf16(const uint16_t* p, lanes::V& even, lanes::V& odd) {
  const lanes::D d;
  const lanes::DU du;
  const auto x = hn::BitCast(du, hn::LoadU(hn::Repartition<uint16_t, lanes::D>(), p));
  even = hn::BitCast(d, hn::ShiftLeft<16>(x));
  odd = hn::BitCast(d, hn::ShiftLeft<16>(hn::ShiftRight<16>(x)));
}
#endif

// out[r][c] = sum_k A[r][k] * B[c][k] for c < C: whole vectors, then the tail through zero-padded
// copies.
template <int R, int C, typename T>
HWY_NOINLINE void DotF32(const T* a, int64_t lda, int64_t kc, const T* b, int64_t ldb, float* out,
                         int64_t ld_out, const stream::Lines& ahead) {
  const lanes::D d;
  const size_t N = hn::Lanes(d);
  // Spread (stream::Ahead): A/B of builds in turn, qwen3-30b-a3b's input gradient, weights cold
  // (ragged_dot_small-cpu-2026-11-27-2/): bf16 (DotSplit) 1.05-1.14x at 8-64 rows a group, level
  // at 2; f32 1.0-1.05 / 1.17-1.24 / 1.02-1.09x at 4 / 8 / 16.
  stream::Ahead<true> pf(ahead, kc / static_cast<int64_t>(N));
  lanes::V s[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) s[r][c] = hn::Zero(d);
  auto step = [&](const T* const* ap, const T* const* bp, size_t i) {
    lanes::V bv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) bv[c] = Load(d, bp[c], i);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const lanes::V av = Load(d, ap[r], i);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) s[r][c] = hn::MulAdd(av, bv[c], s[r][c]);
    }
  };
  const T* ap[R];
  const T* bp[C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) ap[r] = a + r * lda;
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) bp[c] = b + c * ldb;
  size_t i = 0;
  for (; i + N <= static_cast<size_t>(kc); i += N) {
    pf.step();
    step(ap, bp, i);
  }
  if (i < static_cast<size_t>(kc)) {
    HWY_ALIGN T pad[R + C][HWY_MAX_BYTES / sizeof(float)] = {};
    const size_t tail = static_cast<size_t>(kc) - i;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) std::memcpy(pad[r], ap[r] + i, tail * sizeof(T)), ap[r] = pad[r];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      std::memcpy(pad[R + c], bp[c] + i, tail * sizeof(T)), bp[c] = pad[R + c];
    step(ap, bp, 0);
  }
  StoreDotSums<R, C>(d, s, out, ld_out);
}

#if HWY_TARGET != HWY_SCALAR
// DotF32 on bf16 weights, 2N elements a step: out[r][c] = sum_k A[r][k] B[c][k] for c < C, A's
// rows f32 in SplitRows' order (so the FMAs read them from memory), B's 2N elements split into
// their even and odd ones by shifts (SplitBf16). DotF32 widens N elements of A and of B at a time
// (2 shuffles and 2 shifts per 2N of each): 47 GFLOP/s a core against 87 this way (by hand on
// AVX2, in L1, 5 rows x 2 weight rows; the peak ~107; the shape: DotShapeSplit).
template <int R, int C>
HWY_NOINLINE void DotSplit(const float* a, int64_t lda, int64_t kc, const uint16_t* b, int64_t ldb,
                           float* out, int64_t ld_out, const stream::Lines& ahead) {
  const lanes::D d;
  const auto N = static_cast<int64_t>(hn::Lanes(d));
  stream::Ahead<true> pf(ahead, kc / (2 * N));
  lanes::V s[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) s[r][c] = hn::Zero(d);
  // A step at element i, B's rows at bp.
  auto step = [&](const uint16_t* const* bp, int64_t i) {
    lanes::V even[C], odd[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) SplitBf16(bp[c], even[c], odd[c]);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const lanes::V ae = hn::LoadU(d, a + r * lda + i), ao = hn::LoadU(d, a + r * lda + i + N);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) s[r][c] = hn::MulAdd(ae, even[c], s[r][c]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) s[r][c] = hn::MulAdd(ao, odd[c], s[r][c]);
    }
  };
  const uint16_t* bp[C];
  int64_t i = 0;
  for (; i + 2 * N <= kc; i += 2 * N) {
    pf.step();
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) bp[c] = b + c * ldb + i;
    step(bp, i);
  }
  if (i < kc) {  // B's tails in zero-padded copies (A's are zero there)
    HWY_ALIGN uint16_t pad[C][2 * HWY_MAX_BYTES / sizeof(float)] = {};
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) std::copy_n(b + c * ldb + i, kc - i, pad[c]), bp[c] = pad[c];
    step(bp, i);
  }
  StoreDotSums<R, C>(d, s, out, ld_out);
}
#endif

// Runs kernel<R>(rows, ...) for rows in [1, kMax] with R = rows.
template <int kMax, template <int> class Kernel, typename... Args>
HWY_INLINE void WithRows(int rows, Args&&... args) {
  if constexpr (kMax > 0) {
    if (rows == kMax) return Kernel<kMax>::Run(std::forward<Args>(args)...);
    return WithRows<kMax - 1, Kernel>(rows, std::forward<Args>(args)...);
  }
}
// The f32 axpy kernels on B's elements of type TB (A's f32); kWiden as AxpyF32's.
template <typename TB, bool kWiden = false>
struct Axpy {
  // Panels of V vectors.
  template <int V>
  struct Panels {
    template <int R>
    struct K {
      template <typename... Args>
      static void Run(Args&&... args) {
        AxpyF32<R, V, TB, kWiden>(std::forward<Args>(args)...);
      }
    };
  };
  // Panels of 4 vectors; of 2, for up to twice the rows; of 3 (up to kF32QuadRows rows) and of
  // 1 (their last columns).
  template <int R>
  using K = typename Panels<4>::template K<R>;
  template <int R>
  using K2 = typename Panels<2>::template K<R>;
  template <int R>
  using K3 = typename Panels<3>::template K<R>;
  template <int R>
  using K1 = typename Panels<1>::template K<R>;
};
template <typename T, int C = 4>
struct Dot {
  template <int R>
  struct K {
    template <typename... Args>
    static void Run(Args&&... args) {
      DotF32<R, C, T>(std::forward<Args>(args)...);
    }
  };
};
#if HWY_TARGET != HWY_SCALAR
template <int C>
struct Split {
  template <int R>
  struct K {
    template <typename... Args>
    static void Run(Args&&... args) {
      DotSplit<R, C>(std::forward<Args>(args)...);
    }
  };
};
#endif
// Whether bf16 dot products run through DotSplit (on AVX2: AVX-512 CPUs with BF16 run the pair
// kernels, and those without it were not measured), and its shape: up to 2 rows one chunk against
// 4 weight rows, more in chunks of 6 against 2. Each sum takes two dependent FMAs a step (the even
// and odd halves), so a step of S sums waits max(S / 2, 10) cycles (2 FMAs a cycle, 5 cycles'
// latency): 12 sums keep the FMAs busy. By hand on AVX2 (one core, 768 contracted, sums reduced
// per call, weights from L2): 6 x 2 75 GFLOP/s, 4 x 3 65, 5 x 2 55, 4 x 2 55, 2 x 4 45.
template <typename T>
constexpr bool kSplitDot = (HWY_TARGET == HWY_AVX2) && std::is_same_v<T, uint16_t>;
constexpr stream::DotShape DotShapeSplit(int64_t rows) {
  return rows <= 2 ? stream::DotShape{2, 4} : stream::DotShape{6, 2};
}
template <typename... Args>
void DotSplitShaped(stream::DotShape shape, int rows, Args&&... args) {
#if HWY_TARGET != HWY_SCALAR
  if (shape.cols == 4) return WithRows<2, Split<4>::template K>(rows, args...);
  WithRows<6, Split<2>::template K>(rows, args...);
#else
  (void)shape, (void)rows, ((void)args, ...);
#endif
}

// DotF32 in a shape DotShapeF32 gives, for rows <= shape.rows.
template <typename T, typename... Args>
void DotF32Shaped(stream::DotShape shape, int rows, Args&&... args) {
  if constexpr (HWY_TARGET <= HWY_AVX3) {
    if (shape.cols == 1) return WithRows<8, Dot<T, 1>::template K>(rows, args...);
    if (shape.cols == 2) return WithRows<8, Dot<T, 2>::template K>(rows, args...);
  } else {
    if (shape.cols == 2) return WithRows<6, Dot<T, 2>::template K>(rows, args...);
  }
  WithRows<kF32DotRows, Dot<T>::template K>(rows, args...);
}

// C[r][0, cols) (+)= tile[r][0, cols) for r < rows, tile rows ld_tile apart.
template <bool kOutBf16>
void StoreTile(const float* tile, int64_t ld_tile, int64_t rows, int64_t cols, bool accumulate,
               void* c, int64_t ldc) {
  const lanes::D d;
  const size_t N = hn::Lanes(d);
  using Out = std::conditional_t<kOutBf16, uint16_t, float>;
  for (int64_t r = 0; r < rows; ++r) {
    Out* out = static_cast<Out*>(c) + r * ldc;
    float* t = const_cast<float*>(tile) + r * ld_tile;
    if (accumulate) {  // the old values join the sum in f32: one rounding
      size_t i = 0;
      for (; i + N <= static_cast<size_t>(cols); i += N)
        hn::StoreU(hn::Add(hn::LoadU(d, t + i), LoadLanes<kOutBf16>(d, out, i)), d, t + i);
      for (; i < static_cast<size_t>(cols); ++i) t[i] += as_float(out[i]);
    }
    StoreRow<kOutBf16, false>(t, static_cast<size_t>(cols), out, [](lanes::V v) { return v; });
  }
}

// This thread's f32 buffer, vector-aligned, grown as needed.
class Buffer {
 public:
  float* get(size_t n) {
    if (n > size_) p_ = hwy::AllocateAligned<float>(size_ = n);
    return p_.get();
  }

 private:
  hwy::AlignedFreeUniquePtr<float[]> p_;
  size_t size_ = 0;
};
float* ThreadBuffer(size_t n) {
  thread_local Buffer b;
  return b.get(n);
}
float* ThreadPanel(size_t n) {
  thread_local Buffer b;
  return b.get(n);
}
// An f32 panel of weights: the copy of a block's panel of bf16 weights that the first chunk of
// rows leaves for the others (AxpyItem), or a panel of weight rows transposed (TransposedItem).
float* WidePanel(size_t n) {
  thread_local Buffer b;
  return b.get(n);
}
// The calling thread's buffer of a call's parts of the contraction (its OpenMP threads write it).
float* PartsBuffer(size_t n) {
  thread_local Buffer b;
  return b.get(n);
}
// The f32 copy of an item's rows of A (F32Rows).
float* ARowsBuffer(size_t n) {
  thread_local Buffer b;
  return b.get(n);
}

// B's first `cols` columns of kc rows (ldb apart) as an f32 panel of w columns, zero past `cols`,
// in this thread's panel buffer.
template <typename T>
const float* PaddedPanel(const T* b, int64_t ldb, int64_t kc, int64_t cols, int64_t w) {
  float* pp = ThreadPanel(static_cast<size_t>(kc * w));
  for (int64_t k = 0; k < kc; ++k) {
    for (int64_t c = 0; c < w; ++c) pp[k * w + c] = c < cols ? as_float(b[k * ldb + c]) : 0.f;
  }
  return pp;
}

// acc[r][0, cols) += sum_{k < kc} A[r][k] * B[k][0, cols) for r < R, row-major: each weight row
// read front to back (one stream), its products added to the sums in memory (L1). The panels
// (AxpyF32Block) keep a few columns' sums in registers instead and walk every row of the block a
// few columns at a time. For 1-2 rows whose sums fit L1 easily this read faster; A/B in one loop,
// f32 forward, weights cold, one row a group (1-8 tokens), the same blocks (AMD EPYC family 25
// model 17, AVX-512; bench/results/ragged_dot_small-cpu-2026-11-29-3/): row-major against panels
// 1.06-1.44x on qwen3-30b-a3b's 3 KiB rows (three runs), 1.07-1.18x on olmoe-1b-7b's 4 KiB,
// 1.07-1.18x on deepseek-v2-lite's 5.5 KiB; 8 KiB level (deepseek-v3 0.92-1.02x over three
// runs, qwen3-30b-a3b's down 0.99-1.08x), 11 KiB 0.92-1.04x (gpt-oss-20b), 56 KiB 0.73-0.79x
// (mixtral-8x7b, the sums out of L1): kRowMajorSumsBytes. pf steps once per vector of a row.
template <int R, typename T>
HWY_NOINLINE void AxpyRowMajor(const float* a, int64_t lda, int64_t kc, const T* b, int64_t ldb,
                               int64_t cols, float* acc, int64_t ld_acc,
                               const stream::Lines& next) {
  const lanes::D d;
  const auto N = static_cast<int64_t>(hn::Lanes(d));
  const int64_t full = cols / N * N;
  stream::Ahead<true> pf(next, kc * std::max<int64_t>(full / N, 1));
  for (int64_t k = 0; k < kc; ++k) {
    const T* row = b + k * ldb;
    lanes::V av[R];
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) av[r] = hn::Set(d, a[r * lda + k]);
    if (full == 0) pf.step();
    for (int64_t c = 0; c < full; c += N) {
      pf.step();
      const lanes::V w = Load(d, row, static_cast<size_t>(c));
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        float* s = acc + r * ld_acc + c;
        hn::StoreU(hn::MulAdd(av[r], w, hn::LoadU(d, s)), d, s);
      }
    }
    for (int64_t c = full; c < cols; ++c) {
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) acc[r * ld_acc + c] += a[r * lda + k] * as_float(row[c]);
    }
  }
}

// One chunk of up to 2 kF32Rows rows through the f32 kernel, over every panel of a block in one
// call: panels of 4N columns up to kF32Rows rows, of 2N past that (twice the rows' sums in as
// many registers); a last partial panel through a zero-padded f32 copy. acc as in AxpyItem.
template <typename T>
void AxpyF32Block(int rows, const float* a, int64_t lda, int64_t kc, const T* b, int64_t ldb,
                  int64_t cols, float* acc, int64_t ld_acc, const stream::Lines& next) {
  const auto N = static_cast<int64_t>(hn::Lanes(lanes::D()));
  auto run = [&](auto kernel, auto padded_kernel, int64_t w) {
    const int64_t full = cols / w;
    kernel(a, lda, kc, b, ldb, full, acc, ld_acc, next);
    if (full * w == cols) return;
    // (With no full panel, the padded one prefetches the next block.)
    padded_kernel(a, lda, kc, PaddedPanel(b + full * w, ldb, kc, cols - full * w, w), w, int64_t{1},
                  acc + full * w, ld_acc, full > 0 ? stream::Lines{} : next);
  };
  if (rows <= kF32Rows) {
    return run([&](auto&&... x) { WithRows<kF32Rows, Axpy<T>::template K>(rows, x...); },
               [&](auto&&... x) { WithRows<kF32Rows, Axpy<float>::template K>(rows, x...); },
               4 * N);
  }
  run([&](auto&&... x) { WithRows<2 * kF32Rows, Axpy<T>::template K2>(rows, x...); },
      [&](auto&&... x) { WithRows<2 * kF32Rows, Axpy<float>::template K2>(rows, x...); }, 2 * N);
}

// As AxpyF32Block, for up to kF32QuadRows rows on panels of 3N columns: the full ones in one call,
// then those of N, then the last columns through a zero-padded f32 copy of N (acc's rows have room
// for it: they are rounded up to panels of 4N).
template <typename T>
void AxpyF32Block3(int rows, const float* a, int64_t lda, int64_t kc, const T* b, int64_t ldb,
                   int64_t cols, float* acc, int64_t ld_acc, const stream::Lines& next) {
  const auto N = static_cast<int64_t>(hn::Lanes(lanes::D()));
  const int64_t wide = cols / (3 * N), c = wide * 3 * N, narrow = (cols - c) / N,
                c1 = c + narrow * N;
  WithRows<kF32QuadRows, Axpy<T>::template K3>(rows, a, lda, kc, b, ldb, wide, acc, ld_acc, next);
  // The next block's lines go out over the first call that has steps.
  if (narrow > 0) {
    WithRows<kF32QuadRows, Axpy<T>::template K1>(rows, a, lda, kc, b + c, ldb, narrow, acc + c,
                                                 ld_acc, wide > 0 ? stream::Lines{} : next);
  }
  if (c1 == cols) return;
  WithRows<kF32QuadRows, Axpy<float>::template K1>(
      rows, a, lda, kc, PaddedPanel(b + c1, ldb, kc, cols - c1, N), N, int64_t{1}, acc + c1, ld_acc,
      c1 > 0 ? stream::Lines{} : next);
}

// A's rows [0, rows) over [0, kc), lda apart, as f32 rows kc apart in this thread's buffer (bf16
// widened once, so that the f32 kernels broadcast each element straight from memory: widened in
// the kernel, a bf16 element took 4 instructions a row and step, and the forward's kernels ran at
// 41-48 GFLOP/s a core against 104 with f32, by hand on AVX2). f32 rows are used as they are.
template <typename T>
const float* F32Rows(const T* a, int64_t lda, int64_t rows, int64_t kc, int64_t& ld) {
  if constexpr (std::is_same_v<T, float>) {
    ld = lda;
    return a;
  } else {
    ld = kc;
    float* f = ARowsBuffer(static_cast<size_t>(rows * kc));
    const lanes::D d;
    const auto N = static_cast<int64_t>(hn::Lanes(d));
    for (int64_t r = 0; r < rows; ++r) {
      int64_t k = 0;
      for (; k + N <= kc; k += N) hn::StoreU(LoadLanes<true>(d, a + r * lda, k), d, f + r * kc + k);
      for (; k < kc; ++k) f[r * kc + k] = as_float(a[r * lda + k]);
    }
    return f;
  }
}

#if HWY_TARGET != HWY_SCALAR
// An item's rows of A over [0, kc) as f32 in DotSplit's order: each run of 2N elements as its N
// even elements, then its N odd ones; rows ld apart (kc rounded up to 2N, zeros past kc).
const float* SplitRows(const uint16_t* a, int64_t lda, int64_t rows, int64_t kc, int64_t& ld) {
  const lanes::D d;
  const auto N = static_cast<int64_t>(hn::Lanes(d));
  ld = round_up(kc, 2 * N);
  float* f = ARowsBuffer(static_cast<size_t>(rows * ld));
  HWY_ALIGN uint16_t tail[2 * HWY_MAX_BYTES / sizeof(float)];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < kc; i += 2 * N) {
      const uint16_t* src = a + r * lda + i;
      if (i + 2 * N > kc) {
        std::fill_n(tail, 2 * N, uint16_t{0});
        std::copy_n(src, kc - i, tail);
        src = tail;
      }
      lanes::V even, odd;
      SplitBf16(src, even, odd);
      hn::StoreU(even, d, f + r * ld + i);
      hn::StoreU(odd, d, f + r * ld + i + N);
    }
  }
  return f;
}
#endif

// How AxpyItem goes over an item of `rows` rows and `cols` output columns of weights of type T:
// its chunks of rows, whether chunk by chunk over each block (chunk_major), the weight rows per
// block (kb) and whether the blocks go into L1 as they are prefetched (else into L2). An item
// prefetches the next one's first block as the next one's plan says.
struct AxpyPlan {
  stream::Chunks chunks;
  bool chunk_major;
  int64_t kb;
  bool into_l1;
  bool row_major;  // the f32 kernels' 1-2 rows: AxpyRowMajor rather than the panels
};
template <bool kPairs, typename T>
AxpyPlan PlanAxpy(int64_t rows, int64_t cols) {
  const auto es = static_cast<int64_t>(sizeof(T));
  // Chunks of rows: up to kAxpyPanelsRows rows (2 kF32Rows for the f32 kernel) in one, through
  // panels of 2 vectors past kAxpyPanelsWideRows (kF32Rows); more, kAxpyRows (kF32Rows, or
  // 2 kF32Rows where kF32NarrowChunks) at a time.
  constexpr bool kNarrow = !kPairs && kF32NarrowChunks;
  const int64_t one = kPairs ? stream::kAxpyPanelsRows : 2 * kF32Rows;
  const int64_t most = rows <= one ? one
                       : kPairs    ? stream::kAxpyRows
                       : kNarrow   ? 2 * kF32Rows
                                   : kF32Rows;
  // kNarrow: where whole chunks of `most` leave 1 or 2 rows, those chunks and a last one of the
  // rows left, on 4 vectors: by hand in L1, 6 / 4 rows on 2 vectors ran at 105 / 78 GFLOP/s, 2 / 1
  // rows on 4 vectors at 66 / 43, so 8 rows as 6 + 2 beat 4 + 4 on 2 vectors (7 and 8 rows now go
  // as two chunks on 3 vectors: kF32QuadRows says why). A/B in one loop, qwen3-30b-a3b's
  // forward, AMD EPYC family 23 model 49: 7 / 8 / 13 / 14 / 19 / 20 rows a group 1.06 / 1.04 / 1.08
  // / 1.10 / 1.04 / 1.04x, routed 1.02-1.03x; 9 rows as 6 + 3 (3 on 4 vectors) 0.98x, so
  // near-equal chunks elsewhere (bench/results/ragged_dot_small-cpu-2026-11-27/). Now 7-8 rows, and
  // kF32Rows left over whole chunks (chunk-major), go in chunks of 3 to kF32QuadRows on 3 vectors
  // (kF32QuadRows says why).
  const int64_t left = rows % most;
  const bool quads = kNarrow && rows > 2 * kF32Rows && rows <= 2 * kF32QuadRows;
  const bool three_left =
      kNarrow && rows > most && rows <= kChunkMajorMost * most && left == kF32Rows;
  const stream::Chunks chunks =
      quads ? stream::Chunks(rows, kF32QuadRows)
            : stream::Chunks(rows, most,
                             three_left || (kNarrow && rows > most && left > 0 && left <= 2));
  // The f32 kernels on AVX2, 2 to kChunkMajorMost chunks: chunk by chunk over every panel of a
  // block in one call (AxpyF32Block), the later chunks reading the block from L2, in blocks of
  // 32-48 rows; rather than panel by panel through the chunks (the later ones from L1) in blocks
  // of 64 rows or more. Measured on bf16 weights (f32: kF32NarrowChunks), A/B in one loop,
  // weights cold (AMD EPYC family 23 model 49;
  // bench/results/ragged_dot_small-cpu-2026-11-27-3/ab-chunk-major.txt): qwen3-30b-a3b's forward
  // at 6.5 / 8 / 12 / 14 / 16 / 32 rows a group 1.02 / 1.06-1.08 / 1.10-1.11 / 1.08 / 1.05 / 1.05x,
  // 4 KiB weight rows (olmoe-1b-7b's gate|up, deepseek-v3's) at 8 rows 1.14-1.18x, mixtral-8x7b's
  // 28 KiB rows at 8 rows 1.17x; at 64 rows (11 chunks) 0.83-0.94x. Blocks of 48 rows were best on
  // 1.5 KiB rows (32: 1.02-1.05x, 64: 1.05x the old way), of 32 on 4 KiB (48: 1.07-1.09x; 16-24 or
  // 64 rows 0.90-0.99x: bench/results/ragged_dot_small-cpu-2026-11-27-4/ab-chunk-major-blocks-*).
  const bool chunk_major = kNarrow && chunks.count > 1 && chunks.count <= kChunkMajorMost;
  // Rows of B per block: with one chunk of rows, kOneChunkBlockRows or a multiple of it that
  // fills half of L1 (detail::one_chunk_block_rows; the panels then read each block, a few rows
  // long, out of L1 almost as it arrives: 90-104% of the floor at 1-32 tokens where blocks of 64+
  // rows ran at 62-68%), twice that with panels of 2 vectors (they
  // load and store twice the sums per weight: 12 rows ran 25% faster with 16-row blocks than with
  // 8, 4 and 8 rows the same), or for the pair kernels from 3 rows on about kBlockBytes
  // (detail::one_chunk_pair_block_rows says why); chunk-major, 32-48 rows (above); else about
  // kBlockBytes and at least kMinBlockRows (each chunk's sums are loaded and stored once per block
  // and panel).
  const int64_t block_rows = stream::kBlockBytes / std::max<int64_t>(cols * es, 1);
  int64_t kb = 0;
  if (chunks.count > 1) {
    kb = chunk_major ? std::clamp<int64_t>(block_rows, 32, 48)
                     : std::max(stream::kMinBlockRows, block_rows);
  } else {
    kb = kPairs ? stream::one_chunk_pair_block_rows(rows, cols * es)
                : stream::one_chunk_block_rows(cols * es) * (rows > kF32Rows ? 2 : 1);
  }
  kb += kb % 2;  // whole pairs
  // Where the blocks go as they are prefetched: L1 for one chunk's blocks that fit there twice.
  // Row-major: f32 weights on AVX-512, as measured (AxpyRowMajor).
  constexpr bool kRowMajor = !kPairs && std::is_same_v<T, float> && HWY_TARGET <= HWY_AVX3;
  return {chunks, chunk_major, kb, chunks.count == 1 && stream::prefetch_into_l1(kb * cols * es),
          kRowMajor && chunks.count == 1 && one_chunk_row_major(rows, cols)};
}

// The output-contiguous form (B's columns contiguous: b_s1 == 1), one item: blocks of
// contraction rows, panel by panel, chunk by chunk, the next block (after the last, the next
// item's first) prefetched over the calls. kPairs: the bf16-pair kernel (panels of 64, sums in
// pair order); else the f32 kernel (panels of 4N). The item's sums are in `acc` ([rows][cols
// rounded up to panels]).
template <bool kPairs, typename T, bool kOutBf16>
void AxpyItem(const RowGroupedGemm& g, const Item& it, const Item* next_item, float* parts) {
  const int64_t panel = kPairs ? stream::kPanel : static_cast<int64_t>(4 * hn::Lanes(lanes::D()));
  constexpr bool kNarrow = !kPairs && kF32NarrowChunks;
  const AxpyPlan plan = PlanAxpy<kPairs, T>(it.rows, it.cols);
  const stream::Chunks& chunks = plan.chunks;
  const bool chunk_major = plan.chunk_major;
  const int64_t kb = plan.kb;
  const int64_t width = round_up(it.cols, panel);
  float* acc =
      it.partial >= 0 ? parts + it.partial : ThreadBuffer(static_cast<size_t>(it.rows * width));
  std::fill(acc, acc + it.rows * width, 0.f);
  const T* a = static_cast<const T*>(g.a) + it.row * g.lda + it.k0;
  auto weights = [&](const Item& i) {  // from the item's first contraction row
    return static_cast<const T*>(g.b) + i.j * g.b_batch + i.k0 * g.b_s0 + i.col;
  };
  const T* b = weights(it);
  const auto es = static_cast<int64_t>(sizeof(T)), stride = g.b_s0 * es;
  const int64_t kn = it.k1 - it.k0;  // the item's contraction rows, from a's and b's
  auto block_lines = [&](const T* from, int64_t cols, int64_t rows, bool into_l1) {
    stream::Lines l = stream::lines_of(from, stride, cols * es, rows);
    l.into_l1 = into_l1;
    return l;
  };
  stream::Ahead<>(block_lines(b, it.cols, std::min(kb, kn), plan.into_l1), 1).step();
  const int64_t panels = width / panel;
  // The pair kernels' panel buffer, with several chunks (the first leaves the pairs for the rest).
  auto* pairs =
      kPairs && chunks.count > 1
          ? reinterpret_cast<uint32_t*>(ThreadPanel(static_cast<size_t>((kb / 2) * panel)))
          : nullptr;
  // The f32 kernels on bf16 weights (AVX2), panel by panel with 3 chunks or more (past
  // kChunkMajorMost): the first chunk widens each panel of the block into `wide` as it reads it,
  // and the others multiply that f32 copy (from L1) rather than widen it again. A/B in one loop,
  // qwen3-30b-a3b's forward, weights cold (AMD EPYC family 23 model 49;
  // bench/results/ragged_dot_small-cpu-2026-11-27-3/): 14 / 16 / 20 / 32 / 64 rows a group 1.02
  // / 1.04-1.08 / 1.04 / 1.05-1.07 / 1.07x, olmoe-1b-7b's gate|up (4 KiB rows) at 32 rows 1.12x;
  // with 2 chunks (6 + 2 rows, 6 + 6) 0.95-0.97x: the first chunk's stores cost more than the
  // second one saves. (Measured against panel-major without the copy, before chunk_major took
  // items of up to kChunkMajorMost chunks: it now serves more than 36 rows.)
  constexpr bool kWidenOnce = !kPairs && HWY_TARGET == HWY_AVX2 && std::is_same_v<T, uint16_t>;
  float* wide = kWidenOnce && !chunk_major && chunks.count > 2
                    ? WidePanel(static_cast<size_t>(kb * panel))
                    : nullptr;
  const bool even_odd = kPairs && chunks.count == 1 && stream::even_odd_one_chunk();
  // The next item's first block, as its plan says.
  const AxpyPlan next_plan =
      next_item ? PlanAxpy<kPairs, T>(next_item->rows, next_item->cols) : plan;
  const stream::Lines next_first =
      next_item
          ? block_lines(weights(*next_item), next_item->cols,
                        std::min(next_plan.kb, next_item->k1 - next_item->k0), next_plan.into_l1)
          : stream::Lines{};
  for (int64_t k0 = 0; k0 < kn; k0 += kb) {
    const int64_t kc = std::min(kb, kn - k0);
    const stream::Lines next = k0 + kc < kn ? block_lines(b + (k0 + kc) * g.b_s0, it.cols,
                                                          std::min(kb, kn - k0 - kc), plan.into_l1)
                                            : next_first;
    // The f32 kernels' rows of A over the block, as f32.
    int64_t ld_af = 0;
    const float* af = nullptr;
    if constexpr (!kPairs) af = F32Rows(a + k0, g.lda, it.rows, kc, ld_af);
    // One chunk of rows: every (full) panel of the block in one call, the kernels' fixed cost
    // (loading and storing the sums aside) paid once per block, not per panel: 1.2-2.1x on
    // qwen3-30b-a3b's and its layer's shapes at 1-6 rows per group.
    if (chunks.count == 1) {
      if constexpr (kPairs) {
        if (even_odd) {
          int64_t ld_e = 0;
          const float* ae = F32Rows(a + k0, g.lda, it.rows, kc, ld_e);
          stream::axpy_even_odd_panels(static_cast<int>(it.rows), ae, ld_e, kc, b + k0 * g.b_s0,
                                       g.b_s0, it.cols, acc, width, next);
          continue;
        }
        stream::axpy_pairs_panels(it.rows, a + k0, g.lda, kc, b + k0 * g.b_s0, g.b_s0, it.cols, acc,
                                  width, next);
      } else {
        if constexpr (std::is_same_v<T, float>) {  // plan.row_major only on f32 weights
          if (plan.row_major) {
            (it.rows == 1 ? AxpyRowMajor<1, float>
                          : AxpyRowMajor<2, float>)(af, ld_af, kc, b + k0 * g.b_s0, g.b_s0, it.cols,
                                                    acc, width, next);
            continue;
          }
        }
        AxpyF32Block(static_cast<int>(it.rows), af, ld_af, kc, b + k0 * g.b_s0, g.b_s0, it.cols,
                     acc, width, next);
      }
      continue;
    }
    if constexpr (!kPairs) {
      if (chunk_major) {
        for (int64_t ci = 0; ci < chunks.count; ++ci) {
          const int64_t r0 = chunks.begin(ci);
          const int rows = chunks.size(ci);
          (rows >= kF32Rows && rows <= kF32QuadRows
               ? AxpyF32Block3<T>
               : AxpyF32Block<T>)(rows, af + r0 * ld_af, ld_af, kc, b + k0 * g.b_s0, g.b_s0,
                                  it.cols, acc + r0 * width, width,
                                  stream::part(next, ci, chunks.count));
        }
        continue;
      }
    }
    const int64_t calls = panels * chunks.count;
    int64_t call = 0;
    for (int64_t c0 = 0; c0 < width; c0 += panel) {
      const int64_t cols = std::min(panel, it.cols - c0);
      // f32, a partial panel: its columns copied once into a zero-padded panel for every chunk.
      const float* pp = !kPairs && cols < panel
                            ? PaddedPanel(b + k0 * g.b_s0 + c0, g.b_s0, kc, cols, panel)
                            : nullptr;
      for (int64_t ci = 0; ci < chunks.count; ++ci, ++call) {
        const int64_t r0 = chunks.begin(ci);
        const int rows = chunks.size(ci);
        const stream::Lines ahead = stream::part(next, call, calls);
        float* sums = acc + r0 * width + c0;
        if constexpr (kPairs) {
          // The first chunk leaves the block's panel as pairs; the chunks after it read them.
          stream::axpy_pairs(rows, a + r0 * g.lda + k0, g.lda, kc, b + k0 * g.b_s0 + c0, g.b_s0,
                             cols, sums, width, ahead, pairs,
                             r0 > 0 ? stream::PanelUse::kRead : stream::PanelUse::kWrite);
        } else {
          // The panel from B, its zero-padded f32 copy or its f32 copy in `wide`; in one call (4
          // vectors) or two halves side by side (2 vectors, kNarrow past 2 rows).
          const float* ar = af + r0 * ld_af;
          const bool narrow = kNarrow && rows > 2;
          auto chunk = [&](auto kernels, const auto* from, int64_t ld, auto... widen_to) {
            using Kernels = decltype(kernels);
            if (narrow) {
              WithRows<2 * kF32Rows, Kernels::template K2>(
                  rows, ar, ld_af, kc, from, ld, int64_t{2}, sums, width, ahead, widen_to...);
            } else {
              WithRows<kF32Rows, Kernels::template K>(rows, ar, ld_af, kc, from, ld, int64_t{1},
                                                      sums, width, ahead, widen_to...);
            }
          };
          const T* from_b = b + k0 * g.b_s0 + c0;
          if (pp != nullptr) {
            chunk(Axpy<float>{}, pp, panel);
          } else if (wide == nullptr) {
            chunk(Axpy<T>{}, from_b, g.b_s0);
          } else if (r0 == 0) {  // the first chunk widens the panel into `wide`
            chunk(Axpy<T, true>{}, from_b, g.b_s0, wide);
          } else {  // the others multiply that
            chunk(Axpy<float>{}, static_cast<const float*>(wide), panel);
          }
        }
      }
    }
  }
  if constexpr (kPairs) {  // back to column order, in place, panel by panel
    for (int64_t c0 = 0; c0 < width; c0 += panel)
      (even_odd ? stream::even_odd_to_columns : stream::pair_order_to_columns)(
          static_cast<int>(it.rows), acc + c0, width, acc + c0, width);
  }
  if (it.partial >= 0) return;  // a part of the contraction: RunItems adds the parts
  StoreTile<kOutBf16>(acc, width, it.rows, it.cols, g.accumulate,
                      static_cast<char*>(g.c) + (it.row * g.ldc + it.col) * dtype_size(g.out_type),
                      g.ldc);
}

// pan[k][c] = w[c][k] as f32 for k < kc, c < panel (the weight rows past `cols` give 0): `panel`
// weight rows, ldw apart, contiguous along k. On AVX2, 8 x 8 at a time in registers.
template <typename T>
void TransposePanel(const T* w, int64_t ldw, int64_t kc, int64_t cols, float* pan, int64_t panel) {
  int64_t k8 = 0;
#if HWY_TARGET == HWY_AVX2
  k8 = kc / 8 * 8;
  for (int64_t c = 0; c < panel; c += 8) {
    for (int64_t k = 0; k < k8; k += 8) {
      __m256 r[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        r[i] = c + i < cols ? Load(lanes::D(), w + (c + i) * ldw + k, 0).raw : _mm256_setzero_ps();
      }
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]),
                   t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]),
                   t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]),
                   t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xee),
                   s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xee),
                   s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xee),
                   s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xee);
      float* o = pan + k * panel + c;
      _mm256_storeu_ps(o, _mm256_permute2f128_ps(s0, s4, 0x20));
      _mm256_storeu_ps(o + panel, _mm256_permute2f128_ps(s1, s5, 0x20));
      _mm256_storeu_ps(o + 2 * panel, _mm256_permute2f128_ps(s2, s6, 0x20));
      _mm256_storeu_ps(o + 3 * panel, _mm256_permute2f128_ps(s3, s7, 0x20));
      _mm256_storeu_ps(o + 4 * panel, _mm256_permute2f128_ps(s0, s4, 0x31));
      _mm256_storeu_ps(o + 5 * panel, _mm256_permute2f128_ps(s1, s5, 0x31));
      _mm256_storeu_ps(o + 6 * panel, _mm256_permute2f128_ps(s2, s6, 0x31));
      _mm256_storeu_ps(o + 7 * panel, _mm256_permute2f128_ps(s3, s7, 0x31));
    }
  }
#endif
  for (int64_t c = 0; c < panel; ++c) {
    for (int64_t k = k8; k < kc; ++k)
      pan[k * panel + c] = c < cols ? as_float(w[c * ldw + k]) : 0.f;
  }
}

// The contraction-contiguous form (b_s0 == 1) through the axpy kernels of the output-contiguous
// one, for items of more than kSumsRows rows: blocks of contraction rows, panel by panel, each
// panel's weights transposed into the panel buffer and every chunk of rows run on it; the next
// block prefetched over the calls. kPairs: the pair kernels (bf16; panels of 64 weight rows as
// pairs, stream::transpose_pairs), where the contraction is long (stream::long_dot); else the f32
// kernels (AVX2; panels of 4N weight rows as f32, TransposePanel). The sums, in column order, are
// in `acc` ([rows][cols rounded up to panels]). The f32 kernels against the dot products (DotItem),
// A/B in one loop, weights cold (AMD EPYC family 23 model 49,
// bench/results/ragged_dot_small-cpu-2026-11-27-3/ab-transposed.txt): qwen3-30b-a3b's input
// gradient in bf16 at 48 / 64 / 128 / 256 rows a group 1.0 / 1.08-1.09 / 1.15-1.17 / 1.16x, in f32
// at 64 rows 1.07x, at 32 level (most items 32 rows or fewer); its forward against [E, n, K]
// weights 1.19-1.24x at 64-128 rows; mixtral-8x7b's input gradient (a 14336-long contraction) at
// 64 rows 1.19-1.32x. With the transposition in scalar code it took a fifth of the time and the
// path ran 0.92-0.97x; from 13 or 21 rows (the items' sums bounded as here) 0.70-0.95x. The f32
// panel is read by the FMAs from memory, so chunks of kF32Rows on 4 vectors, whatever the weights'
// type (AxpyItem's chunks of 2 kF32Rows on 2 vectors, which bf16 weights took here before, ran
// 1.01-1.05x slower: A/B in one loop, weights cold, bf16, input gradient of qwen3-30b-a3b at 48 /
// 64 / 128 rows a group 1.04 / 1.03 / 1.05x, of deepseek-v3's shape at 64 / 128 1.03-1.05 / 1.01x,
// of mixtral-8x7b's down at 64 1.04x, qwen3's forward against [E, n, K] at 64 / 128 1.02-1.03 /
// 1.02x; bench/results/ragged_dot_small-cpu-2026-11-27-6/ab-transposed-chunks.txt).
template <bool kPairs, typename T, bool kOutBf16>
void TransposedItem(const RowGroupedGemm& g, const Item& it, const Item* next_item) {
  const int64_t panel = kPairs ? stream::kPanel : static_cast<int64_t>(4 * hn::Lanes(lanes::D()));
  const stream::Chunks chunks(it.rows, kPairs ? stream::kAxpyRows : kF32Rows);
  const int64_t width = round_up(it.cols, panel);
  float* acc = ThreadBuffer(static_cast<size_t>(it.rows * width));
  std::fill(acc, acc + it.rows * width, 0.f);
  const T* a = static_cast<const T*>(g.a) + it.row * g.lda;
  auto weights = [&](const Item& i) {
    return static_cast<const T*>(g.b) + i.j * g.b_batch + i.col * g.b_s1;
  };
  const T* b = weights(it);
  const auto es = static_cast<int64_t>(sizeof(T)), stride = g.b_s1 * es;
  // Contraction rows per block: about kBlockBytes of the item's weight rows (counted in whole
  // panels, as the panel buffer holds them), whole pairs.
  int64_t kb = std::max(stream::kMinBlockRows, stream::kBlockBytes / (width * es));
  kb += kb % 2;
  auto region = [&](const T* w, int64_t cols, int64_t k0) {
    return stream::lines_of(w + k0, stride, std::min(kb, g.kc - k0) * es, cols);
  };
  stream::Ahead<>(region(b, it.cols, 0), 1).step();
  // The panel buffer: [kb / 2][panel] pairs, or [kb][panel] f32.
  float* pan = kPairs ? ThreadPanel(static_cast<size_t>((kb / 2) * panel))
                      : WidePanel(static_cast<size_t>(kb * panel));
  auto* pairs = reinterpret_cast<uint32_t*>(pan);
  const int64_t calls = width / panel * chunks.count;
  for (int64_t k0 = 0; k0 < g.kc; k0 += kb) {
    const int64_t kc = std::min(kb, g.kc - k0);
    const stream::Lines next = k0 + kc < g.kc ? region(b, it.cols, k0 + kc)
                               : next_item    ? region(weights(*next_item), next_item->cols, 0)
                                              : stream::Lines{};
    // The f32 kernels' rows of A over the block, as f32.
    int64_t ld_af = 0;
    const float* af = nullptr;
    if constexpr (!kPairs) af = F32Rows(a + k0, g.lda, it.rows, kc, ld_af);
    int64_t call = 0;
    for (int64_t c0 = 0; c0 < width; c0 += panel) {
      const T* w = b + c0 * g.b_s1 + k0;
      const int64_t cols = std::min(panel, it.cols - c0);
      if constexpr (kPairs) {
        stream::transpose_pairs(w, g.b_s1, kc, cols, pairs);
      } else {
        TransposePanel(w, g.b_s1, kc, cols, pan, panel);
      }
      for (int64_t ci = 0; ci < chunks.count; ++ci, ++call) {
        const int64_t r0 = chunks.begin(ci);
        const int rows = chunks.size(ci);
        const stream::Lines ahead = stream::part(next, call, calls);
        float* sums = acc + r0 * width + c0;
        if constexpr (kPairs) {
          stream::axpy_pairs(rows, a + r0 * g.lda + k0, g.lda, kc, nullptr, 0, panel, sums, width,
                             ahead, pairs, stream::PanelUse::kRead);
        } else {
          WithRows<kF32Rows, Axpy<float>::template K>(rows, af + r0 * ld_af, ld_af, kc,
                                                      static_cast<const float*>(pan), panel,
                                                      int64_t{1}, sums, width, ahead);
        }
      }
    }
  }
  StoreTile<kOutBf16>(acc, width, it.rows, it.cols, g.accumulate,
                      static_cast<char*>(g.c) + (it.row * g.ldc + it.col) * dtype_size(g.out_type),
                      g.ldc);
}

// The contraction-contiguous form (b_s0 == 1), one item: its output columns are weight rows.
// With several chunks on AVX-512, the contraction goes in spans of about kSpanBytes per row (so
// that a chunk's span of rows stays in L1, and the item's in L2, however long the rows); on AVX2
// in one span: there a chunk's rows are f32 (DotSplit's, or f32 inputs) and read by the FMAs from
// L2 at no cost, while spans cut each weight row into pieces read a super-block apart and add
// their sums span by span. A/B in one loop, weights cold (AMD EPYC family 23 model 49,
// bench/results/ragged_dot_small-cpu-2026-11-27-4/ab-spans*.txt), one span against spans of 4
// KiB of f32 rows, input gradient at 8 / 16-17 / 32 rows a group: bf16 deepseek-v2-lite (1408
// contracted) 1.32 / 1.22 / 1.18x, gpt-oss-20b (2880) 1.21 at 8, 1.15 at 32, mixtral-8x7b
// (14336) 1.39 at 8, 1.12 at 32, deepseek-v3 (2048, 2 spans before) 1.25 / 1.15 / 1.14x; in f32
// 1.10-1.35x (deepseek-v3's at 8 rows 1.23x). Within a span, the weight rows go by
// super-blocks of about kBlockBytes, each prefetched over the calls of the one before, each chunk
// of rows over a super-block's weight rows `per_call` at a time (the first chunk from memory, the
// others from L2; stream::dot_shape and DotShapeF32 say how many rows and weight rows, by the
// item's rows). The kernels return `per_call` sums per row, added into `out` ([rows][cols rounded
// up to 4]).
template <bool kPairs, typename T, bool kOutBf16>
void DotItem(const RowGroupedGemm& g, const Item& it, const Item* next_item) {
  constexpr bool kSplit = !kPairs && kSplitDot<T>;
  constexpr bool kSpans = HWY_TARGET <= HWY_AVX3;
  const auto es = static_cast<int64_t>(sizeof(T));
  // The contraction's span (elements, whole steps of the kernels: 32) of an item in `count`
  // chunks: spans of near-equal length of about kSpanBytes with several chunks on AVX-512, else
  // the whole contraction (one chunk reads whole weight rows: a streamed row is read front to
  // back).
  auto span_of = [&](int64_t count) {
    const int64_t spans =
        !kSpans || count == 1 ? 1 : (g.kc * es + stream::kSpanBytes - 1) / stream::kSpanBytes;
    return ((g.kc + spans - 1) / spans + 31) / 32 * 32;
  };
  stream::DotShape shape = kPairs   ? stream::dot_shape(it.rows)
                           : kSplit ? DotShapeSplit(it.rows)
                                    : DotShapeF32(it.rows);
  // The shapes of one weight row a call (and the pair kernels' of two) read the chunk's rows again
  // for every weight row: where those rows do not stay in L1 (their span's bytes past three
  // quarters of it: dot_chunk_fits_l1), chunks of 6 against 4 read them a quarter as often. A/B in
  // one loop against the same build without this, weights cold, every group the same rows / rows
  // spread (--imbalance 0 / 0.25), on an AMD EPYC family 25 model 17 (32 KiB of L1d;
  // bench/results/ragged_dot_small-cpu-2026-11-29-4/dot-l1-committed.txt), bf16 input gradients:
  // mixtral-8x7b's (28 KiB rows) at 1 / 2 / 4 / 6 / 8 rows a group 1.05 / 1.07 / 1.43 / 1.96 /
  // 1.79x and 1.09 / 1.26 / 1.54 / 1.57 / 1.44x, gpt-oss-20b's (5.6 KiB) at 5 / 6 / 8 rows 1.14 /
  // 1.79 / 1.49x and 1.55 / 1.78 / 1.54x, deepseek-v3's (4 KiB) at 8 / 16 rows 1.31 / 1.14x
  // (spread: 0.99-1.07x); f32, deepseek-v3's (8 KiB) at 4 rows 1.24x, spread 1.08-1.10x at 3-5 on
  // average, mixtral-8x7b's (56 KiB) at 1 / 2 / 4 rows 1.05 / 1.15 / 1.40x and 1.08 / 1.11 / 1.21x;
  // where every chunk fits (qwen3-30b-a3b's, 12 rows of mixtral-8x7b's: two chunks of 6 on spans)
  // level. Found and sized with forced shapes (dot-l1.txt): 6 x 4 where the chunk fits ran
  // 0.85-0.99x (deepseek-v3's f32 at 1-3 rows, bf16 at 10-12), and the f32 kernels' chunks of 5-8
  // rows against 2 stay (6 x 4 there 0.89-1.00x on mixtral-8x7b's f32).
  if (kSpans && (shape.cols == 1 || (kPairs && shape.cols == 2))) {  // AVX-512 (no DotSplit)
    const stream::Chunks c(it.rows, shape.rows);
    const int64_t most = (it.rows + c.count - 1) / c.count;  // its largest chunk's rows
    if (!stream::dot_chunk_fits_l1(most * std::min(span_of(c.count), g.kc) * es))
      shape = stream::kDotWide;
  }
  const stream::Chunks chunks(it.rows, shape.rows);
  const int64_t per_call = shape.cols;  // weight rows (output columns) per kernel call
  const int64_t width = (it.cols + 3) / 4 * 4;
  float* out = ThreadBuffer(static_cast<size_t>(it.rows * width));
  const T* a = static_cast<const T*>(g.a) + it.row * g.lda;
  auto weights = [&](const Item& i) {
    return static_cast<const T*>(g.b) + i.j * g.b_batch + i.col * g.b_s1;
  };
  const T* b = weights(it);
  if (it.cols < 4) {  // fewer than 4 weight rows: f32 copies, the missing rows 0
    float* p = ThreadPanel(static_cast<size_t>((4 + kF32DotRows) * g.kc));
    float* a32 = p + 4 * g.kc;
    for (int64_t c = 0; c < 4; ++c)
      for (int64_t k = 0; k < g.kc; ++k)
        p[c * g.kc + k] = c < it.cols ? as_float(b[c * g.b_s1 + k]) : 0.f;
    for (int64_t r0 = 0; r0 < it.rows; r0 += kF32DotRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kF32DotRows, it.rows - r0));
      for (int r = 0; r < rows; ++r)
        for (int64_t k = 0; k < g.kc; ++k) a32[r * g.kc + k] = as_float(a[(r0 + r) * g.lda + k]);
      WithRows<kF32DotRows, Dot<float>::template K>(rows, a32, g.kc, g.kc, p, g.kc,
                                                    out + r0 * width, width, stream::Lines{});
    }
  } else {
    const int64_t stride = g.b_s1 * es;
    // Contraction spans (span_of); within a span, super-blocks of weight rows of about
    // kBlockBytes.
    const int64_t span = span_of(chunks.count);
    const int64_t spans = (g.kc + span - 1) / span;
    if (spans > 1) std::fill(out, out + it.rows * width, 0.f);  // sums added span by span
    const int64_t sb = std::max<int64_t>(4, stream::kBlockBytes / (span * es) / 4 * 4);
    // The lines of super-block [s0, s0 + sb) of span k0 of an item's weights.
    auto region = [&](const T* w, int64_t cols, int64_t k0, int64_t s0) {
      return stream::lines_of(w + s0 * g.b_s1 + k0, stride, std::min(span, g.kc - k0) * es,
                              std::min(sb, cols - s0));
    };
    float sums[stream::kDotMostSums];
    for (int64_t k0 = 0; k0 < g.kc; k0 += span) {
      const int64_t kc = std::min(span, g.kc - k0);
      // kSplit: the item's rows over the span, as f32 in DotSplit's order.
      int64_t ld_af = 0;
      const float* af = nullptr;
#if HWY_TARGET != HWY_SCALAR
      if constexpr (kSplit) af = SplitRows(a + k0, g.lda, it.rows, kc, ld_af);
#endif
      for (int64_t s0 = 0; s0 < it.cols; s0 += sb) {
        const int64_t s1 = std::min(s0 + sb, it.cols);
        // The next super-block: of this span, of the next, or the next item's first.
        const stream::Lines next = s1 < it.cols       ? region(b, it.cols, k0, s1)
                                   : k0 + span < g.kc ? region(b, it.cols, k0 + span, 0)
                                   : next_item != nullptr
                                       ? region(weights(*next_item), next_item->cols, 0, 0)
                                       : stream::Lines{};
        const int64_t calls = chunks.count * ((s1 - s0 + per_call - 1) / per_call);
        int64_t call = 0;
        for (int64_t ci = 0; ci < chunks.count; ++ci) {
          const int64_t r0 = chunks.begin(ci);
          const int rows = chunks.size(ci);
          for (int64_t c0 = s0; c0 < s1; c0 += per_call, ++call) {
            // A last block of fewer than `per_call` weight rows moves back over columns already
            // summed: of its sums only the new columns' are added.
            const int64_t at = std::min(c0, it.cols - per_call);
            const stream::Lines ahead = stream::part(next, call, calls);
            // One span: the sums go straight into `out` (a moved-back block writes its old
            // columns' values again); several: through `sums`, added.
            float* to = spans == 1 ? out + r0 * width + at : sums;
            const int64_t ld_to = spans == 1 ? width : per_call;
            if constexpr (kPairs) {
              stream::dot_pairs(shape, rows, a + r0 * g.lda + k0, g.lda, kc, b + at * g.b_s1 + k0,
                                g.b_s1, to, ld_to, ahead);
            } else if constexpr (kSplit) {
              DotSplitShaped(shape, rows, af + r0 * ld_af, ld_af, kc, b + at * g.b_s1 + k0, g.b_s1,
                             to, ld_to, ahead);
            } else {
              DotF32Shaped<T>(shape, rows, a + r0 * g.lda + k0, g.lda, kc, b + at * g.b_s1 + k0,
                              g.b_s1, to, ld_to, ahead);
            }
            if (spans == 1) continue;
            for (int r = 0; r < rows; ++r) {
              float* o = out + (r0 + r) * width;
              for (int64_t c = c0; c < at + per_call; ++c) o[c] += sums[r * per_call + (c - at)];
            }
          }
        }
      }
    }
  }
  StoreTile<kOutBf16>(out, width, it.rows, it.cols, g.accumulate,
                      static_cast<char*>(g.c) + (it.row * g.ldc + it.col) * dtype_size(g.out_type),
                      g.ldc);
}

// Thread t of `threads`' share of adding the parts of the contraction (items with partial >= 0,
// each group's consecutive): of each such group, a range of columns, every part's sums added into
// the first part's and stored.
template <bool kOutBf16>
void AddParts(const RowGroupedGemm& g, const std::vector<Item>& items, float* parts, int64_t panel,
              int t, int threads) {
  const auto n = static_cast<int64_t>(items.size());
  for (int64_t i = 0; i < n;) {
    if (items[i].partial < 0) {
      ++i;
      continue;
    }
    const Item& first = items[i];
    int64_t end = i + 1;
    while (end < n && items[end].partial >= 0 && items[end].j == first.j &&
           items[end].row == first.row && items[end].col == first.col)
      ++end;
    const int64_t width = round_up(first.cols, panel);
    // This thread's columns: whole 16-column runs, near-equal.
    const int64_t runs = (first.cols + 15) / 16;
    const int64_t c0 = std::min(first.cols, runs * t / threads * 16);
    const int64_t c1 = std::min(first.cols, runs * (t + 1) / threads * 16);
    float* sum = parts + first.partial;
    if (c1 > c0) {
      for (int64_t p = i + 1; p < end; ++p) {
        const float* part = parts + items[p].partial;
        for (int64_t r = 0; r < first.rows; ++r)
          for (int64_t c = c0; c < c1; ++c) sum[r * width + c] += part[r * width + c];
      }
      StoreTile<kOutBf16>(
          sum + c0, width, first.rows, c1 - c0, g.accumulate,
          static_cast<char*>(g.c) + (first.row * g.ldc + first.col + c0) * dtype_size(g.out_type),
          g.ldc);
    }
    i = end;
  }
}

template <bool kPairs, typename T, bool kOutBf16>
void RunItems(const RowGroupedGemm& g) {
  const int64_t panel = kPairs ? stream::kPanel : static_cast<int64_t>(4 * hn::Lanes(lanes::D()));
  // The contraction-contiguous form's items of more than kSumsRows rows on transposed panels: the
  // pair kernels' where the contraction is long (stream::long_dot), the f32 kernels' on AVX2
  // (TransposedItem says why).
  const bool transposed = kPairs ? stream::long_dot(g) : HWY_TARGET == HWY_AVX2;
  const std::vector<Item> items =
      stream::items(g, panel, kPairs ? stream::kAxpyPanelsRows : 2 * kF32Rows, transposed,
                    HWY_TARGET > HWY_AVX3 ? stream::kWholeRowBytes : stream::kSpanBytes);
  int64_t part_floats = 0;  // the parts of the contraction's sums
  for (const Item& it : items) {
    if (it.partial >= 0)
      part_floats = std::max(part_floats, it.partial + it.rows * round_up(it.cols, panel));
  }
  float* parts = part_floats > 0 ? PartsBuffer(static_cast<size_t>(part_floats)) : nullptr;
#pragma omp parallel
  {
    // This thread's items: a contiguous run of them (stream::share), each prefetching the start
    // of the next as it ends.
    const auto [begin, end] = stream::share(items, omp_get_thread_num(), omp_get_num_threads());
    for (int64_t i = begin; i < end; ++i) {
      const Item* next = i + 1 < end ? &items[i + 1] : nullptr;
      if (g.b_s1 == 1) {
        AxpyItem<kPairs, T, kOutBf16>(g, items[i], next, parts);
      } else if (transposed && items[i].rows > stream::kSumsRows) {
        TransposedItem<kPairs, T, kOutBf16>(g, items[i], next);
      } else {
        DotItem<kPairs, T, kOutBf16>(g, items[i], next);
      }
    }
    if (parts != nullptr) {  // every part written: add them
#pragma omp barrier
      AddParts<kOutBf16>(g, items, parts, panel, omp_get_thread_num(), omp_get_num_threads());
    }
  }
}

void Run(const RowGroupedGemm& g) {
  const bool out_bf16 = g.out_type == DType::kBF16;
  if (g.in_type == DType::kBF16) {
    // The pair kernels on an AVX-512 target of a CPU with AVX512-BF16 (a test that runs each
    // Highway target in turn then also runs the f32 kernels on bf16 here).
    if (HWY_TARGET <= HWY_AVX3 && stream::has_avx512_bf16()) {
      return out_bf16 ? RunItems<true, uint16_t, true>(g) : RunItems<true, uint16_t, false>(g);
    }
    return out_bf16 ? RunItems<false, uint16_t, true>(g) : RunItems<false, uint16_t, false>(g);
  }
  return out_bf16 ? RunItems<false, float, true>(g) : RunItems<false, float, false>(g);
}

}  // namespace moekit::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
// GCC 12 warns that the AVX-512 intrinsics' own headers may use (or use) an uninitialised value
// (_mm512_undefined_*, by design): not this file's code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
namespace moekit::detail {

OneChunkSplit one_chunk_split(int64_t busy, int64_t threads, int64_t row_bytes, int64_t kc) {
  if (busy <= 0 || threads <= 1) return {1, 1};
  if (busy < threads) {
    return {1,
            std::min((threads + busy - 1) / busy, std::max<int64_t>(1, kc / stream::kMinPartRows))};
  }
  if (busy % threads == 0) return {1, 1};
  return {std::min(threads / std::gcd(busy, threads),
                   std::max<int64_t>(1, row_bytes / stream::kLongRunBytes)),
          1};
}

int64_t wide_sums_budget(int64_t l2_bytes) {
  return std::clamp(l2_bytes > 0 ? l2_bytes / 4 : stream::kMinWideSumsBytes,
                    stream::kMinWideSumsBytes, stream::kMaxWideSumsBytes);
}

namespace {
std::atomic<int64_t> wide_sums_for_test{0};  // set_stream_wide_sums_for_test; 0: the machine's
std::atomic<int> even_odd_for_test{-1};      // set_even_odd_for_test; -1: the machine's
}  // namespace

void set_stream_wide_sums_for_test(int64_t bytes) { wide_sums_for_test = bytes; }
void set_even_odd_for_test(int mode) { even_odd_for_test = mode; }

bool prefetch_into_l1(int64_t block_bytes, int64_t l1d_bytes) {
  return 2 * block_bytes <= (l1d_bytes > 0 ? l1d_bytes : int64_t{32} << 10);
}

int64_t one_chunk_block_rows(int64_t row_bytes, int64_t l1d_bytes) {
  const int64_t block = stream::kOneChunkBlockRows * std::max<int64_t>(row_bytes, 1);
  return stream::kOneChunkBlockRows * std::max<int64_t>(1, l1d_bytes / 2 / block);
}

bool dot_chunk_fits_l1(int64_t chunk_bytes, int64_t l1d_bytes) {
  const int64_t l1 = l1d_bytes > 0 ? l1d_bytes : int64_t{32} << 10;
  return chunk_bytes <= l1 / 4 * 3;
}

bool one_chunk_row_major(int64_t rows, int64_t cols) {
  return rows >= 1 && rows <= 2 && cols >= 0 &&
         rows * cols * static_cast<int64_t>(sizeof(float)) <= stream::kRowMajorSumsBytes;
}

int64_t one_chunk_pair_block_rows(int64_t rows, int64_t row_bytes, int64_t l1d_bytes) {
  const int64_t l1 = one_chunk_block_rows(row_bytes, l1d_bytes);
  if (rows < stream::kPairLongBlockRows) return l1;
  return std::max(l1 * (rows > stream::kAxpyPanelsWideRows ? 2 : 1),
                  stream::kBlockBytes / std::max<int64_t>(row_bytes, 1));
}

namespace stream {

namespace {
// This machine's L1 data cache per core, in bytes (0 or less where it does not say).
int64_t l1d_bytes() {
  static const int64_t l1d = sysconf(_SC_LEVEL1_DCACHE_SIZE);
  return l1d;
}
}  // namespace

int64_t one_chunk_block_rows(int64_t row_bytes) {
  return detail::one_chunk_block_rows(row_bytes, l1d_bytes());
}

int64_t one_chunk_pair_block_rows(int64_t rows, int64_t row_bytes) {
  return detail::one_chunk_pair_block_rows(rows, row_bytes, l1d_bytes());
}

bool prefetch_into_l1(int64_t block_bytes) {
  return detail::prefetch_into_l1(block_bytes, l1d_bytes());
}

bool dot_chunk_fits_l1(int64_t chunk_bytes) {
  return detail::dot_chunk_fits_l1(chunk_bytes, l1d_bytes());
}

int64_t wide_sums_bytes() {
  if (const int64_t bytes = wide_sums_for_test.load(); bytes > 0) return bytes;
  static const int64_t machine = wide_sums_budget(sysconf(_SC_LEVEL2_CACHE_SIZE));
  return machine;
}

std::vector<Item> items(const RowGroupedGemm& g, int64_t panel, int64_t chunk, bool transposed,
                        int64_t whole_row_bytes) {
  int64_t busy = 0;  // groups with rows
  for (int64_t j = 0; j < g.groups.num_local; ++j) busy += g.groups.sizes[g.groups.offset + j] > 0;
  // Slabs per group, in whole panels: enough items for 4 per thread where the groups alone are
  // fewer; in the output-contiguous form, with more than one chunk of rows, rows of at most
  // kSpanBytes past whole_row_bytes (a block of them and the chunks' sums stay in L2); in the
  // other, at most kDotItemCols columns. The output-contiguous form's groups of one chunk:
  // one_chunk_split.
  const int64_t threads = omp_get_max_threads();
  const int64_t want = 4 * threads, panels = (g.n + panel - 1) / panel;
  const int64_t sums_budget = wide_sums_bytes();
  const OneChunkSplit one_chunk =
      one_chunk_split(busy, threads, g.n * static_cast<int64_t>(dtype_size(g.in_type)), g.kc);
  int64_t partial = 0;  // the floats of the parts' sums so far
  const int64_t balance = busy >= want ? 1 : (want + busy - 1) / std::max<int64_t>(busy, 1);
  const int64_t row_bytes = g.n * static_cast<int64_t>(dtype_size(g.in_type));
  const int64_t wide = g.b_s1 != 1                    ? (g.n + kDotItemCols - 1) / kDotItemCols
                       : row_bytes <= whole_row_bytes ? 1
                                                      : (row_bytes + kSpanBytes - 1) / kSpanBytes;
  std::vector<Item> out;
  int64_t row = local_rows(g.groups).begin;
  for (int64_t j = 0; j < g.groups.num_local; ++j) {
    const int64_t rows = g.groups.sizes[g.groups.offset + j];
    const Chunks runs(rows, kItemRows);
    // Runs of more than kSumsRows rows on the pair kernels' panels (the output-contiguous form, or
    // `transposed`): sums of kSumsBytes at most.
    const int64_t run_rows = runs.count > 0 ? (rows + runs.count - 1) / runs.count : 0;
    const int64_t fit = (g.b_s1 == 1 || transposed) && run_rows > kSumsRows
                            ? (run_rows * g.n * 4 + kSumsBytes - 1) / kSumsBytes
                            : 1;
    const bool one = g.b_s1 == 1 && rows <= chunk;
    const int64_t wide_sums = one && g.in_type == DType::kBF16 && g.n * 2 > kWideRowBytes
                                  ? (rows * g.n * 4 + sums_budget - 1) / sums_budget
                                  : 1;
    const int64_t slabs = std::min(
        panels, one ? std::max(one_chunk.slabs, wide_sums)
                    : std::max(balance, g.b_s1 != 1 || rows > chunk ? std::max(wide, fit) : 1));
    const int64_t slab = (panels + slabs - 1) / slabs * panel;
    const int64_t parts = one ? one_chunk.parts : 1;
    for (int64_t r = 0; r < runs.count; ++r) {
      for (int64_t col = 0; col < g.n; col += slab) {
        const int64_t cols = std::min(slab, g.n - col);
        if (parts == 1) {
          out.push_back({j, row + runs.begin(r), runs.size(r), col, cols, 0, g.kc, -1});
          continue;
        }
        // Parts of whole pairs of contraction rows, the last to the end.
        for (int64_t p = 0; p < parts; ++p) {
          const int64_t k0 = g.kc * p / parts / 2 * 2;
          const int64_t k1 = p + 1 == parts ? g.kc : g.kc * (p + 1) / parts / 2 * 2;
          out.push_back({j, row + runs.begin(r), runs.size(r), col, cols, k0, k1, partial});
          partial += runs.size(r) * round_up(cols, panel);
        }
      }
    }
    row += rows;
  }
  return out;
}

std::pair<int64_t, int64_t> share(const std::vector<Item>& items, int t, int threads) {
  auto cost = [](const Item& it) {
    return static_cast<double>(it.cols) * static_cast<double>(std::max(it.rows, kComputeRows)) *
           static_cast<double>(it.k1 - it.k0);
  };
  double total = 0;
  for (const Item& it : items) total += cost(it);
  // Item i goes to the thread whose share of the total holds the middle of its cost.
  auto owner = [&](double at) {
    return std::min<int64_t>(threads - 1, static_cast<int64_t>(at / total * threads));
  };
  int64_t begin = -1, end = -1;
  double at = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
    const double c = cost(items[i]);
    if (owner(at + c / 2) == t) {
      if (begin < 0) begin = i;
      end = i + 1;
    }
    at += c;
  }
  return begin < 0 ? std::pair<int64_t, int64_t>{0, 0} : std::pair{begin, end};
}

bool has_avx512_bf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512f");
  return has;
}

namespace {

// f(std::integral_constant<int, rows>) for rows in [1, kMax].
template <int kMax, class F>
void with_rows(int rows, F&& f) {
  if constexpr (kMax > 1) {
    if (rows < kMax) return with_rows<kMax - 1>(rows, f);
  }
  f(std::integral_constant<int, kMax>{});
}

// The pair (A[2kp], A[2kp + 1]) broadcast to every lane.
MOEKIT_AVX512_BF16 inline __m512bh pair_at(const uint16_t* a) {
  int32_t w;
  std::memcpy(&w, a, sizeof(w));
  return (__m512bh)_mm512_set1_epi32(w);
}

// 32 columns of a weight row from p: all, or where kFull is false those of mask m (the rest 0).
template <bool kFull>
MOEKIT_AVX512_BF16 inline __m512i load_row(const uint16_t* p, __mmask32 m) {
  if constexpr (kFull) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi16(m, p);
}

// Rows 2kp and 2kp + 1 (y: zero for a last odd row) of each column, as pairs: vector 2h + 0
// takes, per 128-bit lane q, columns 32h + 8q + [0, 4); vector 2h + 1 columns 32h + 8q + [4, 8)
// (the pair order).
template <int V>
MOEKIT_AVX512_BF16 inline void interleave(const __m512i (&x)[V / 2], const __m512i (&y)[V / 2],
                                          __m512i (&v)[V]) {
#pragma GCC unroll 2
  for (int h = 0; h < V / 2; ++h)
    v[2 * h] = _mm512_unpacklo_epi16(x[h], y[h]), v[2 * h + 1] = _mm512_unpackhi_epi16(x[h], y[h]);
}

template <int R, int V>
MOEKIT_AVX512_BF16 inline void axpy_step(__m512 (&s)[R][V], const uint16_t* a, int64_t lda,
                                         const __m512i (&v)[V], bool odd_last) {
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    const __m512bh av = odd_last ? (__m512bh)_mm512_set1_epi32(a[r * lda]) : pair_at(a + r * lda);
#pragma GCC unroll 4
    for (int i = 0; i < V; ++i) s[r][i] = _mm512_dpbf16_ps(s[r][i], av, (__m512bh)v[i]);
  }
}

// Where a chunk's weight pairs come from: the weights, interleaved as it goes (and kept in the
// panel for the chunks after it, kSourceStore), or that panel ([ceil(kc / 2)][64] pairs).
enum class From { kSource, kSourceStore, kPanel };

// The masks of a panel's V / 2 runs of 32 columns, of which the first `cols` exist.
template <int V>
MOEKIT_AVX512_BF16 inline void panel_masks(int64_t cols, __mmask32 (&m)[V / 2]) {
#pragma GCC unroll 2
  for (int h = 0; h < V / 2; ++h) {
    const int64_t c = std::clamp<int64_t>(cols - 32 * h, 0, 32);
    m[h] = c == 32 ? ~__mmask32{0} : __mmask32((1u << c) - 1);
  }
}

// s[r][i] = acc[r][16i, 16i + 16) (kStore false), or the other way, for r < R, i < V.
template <int R, int V, bool kStore>
MOEKIT_AVX512_BF16 inline void move_sums(__m512 (&s)[R][V], float* acc, int64_t ld_acc) {
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int i = 0; i < V; ++i) {
      if constexpr (kStore) {
        _mm512_storeu_ps(acc + r * ld_acc + 16 * i, s[r][i]);
      } else {
        s[r][i] = _mm512_loadu_ps(acc + r * ld_acc + 16 * i);
      }
    }
  }
}

// acc[r][0, 16V) += the block's products for r < R: R rows of V vectors of sums (16V columns,
// of which the first `cols` exist where kFull is false).
template <int R, int V, bool kFull, From kFrom>
MOEKIT_AVX512_BF16 inline void axpy_panel(const uint16_t* a, int64_t lda, int64_t kc,
                                          const uint16_t* b, int64_t ldb, int64_t cols, float* acc,
                                          int64_t ld_acc, Ahead<>& pf, uint32_t* panel) {
  static_assert(V == 2 || V == 4);
  __mmask32 m[V / 2];
  panel_masks<V>(cols, m);
  __m512 s[R][V];
  move_sums<R, V, false>(s, acc, ld_acc);
  // The pairs of pair kp (the last, of an odd contraction, with zeros for its second row).
  auto pairs_at = [&](int64_t kp, bool odd_last, __m512i(&v)[V]) MOEKIT_AVX512_BF16 {
    if constexpr (kFrom == From::kPanel) {
#pragma GCC unroll 4
      for (int i = 0; i < V; ++i) v[i] = _mm512_load_si512(panel + kp * kPanel + 16 * i);
    } else {
      const uint16_t* r0 = b + 2 * kp * ldb;
      __m512i x[V / 2], y[V / 2];
#pragma GCC unroll 2
      for (int h = 0; h < V / 2; ++h) {
        x[h] = load_row<kFull>(r0 + 32 * h, m[h]);
        y[h] = odd_last ? _mm512_setzero_si512() : load_row<kFull>(r0 + ldb + 32 * h, m[h]);
      }
      interleave<V>(x, y, v);
      if constexpr (kFrom == From::kSourceStore) {
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) _mm512_store_si512(panel + kp * kPanel + 16 * i, v[i]);
      }
    }
  };
  const int64_t pairs = kc / 2;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    pf.step();
    __m512i v[V];
    pairs_at(kp, false, v);
    axpy_step<R, V>(s, a + 2 * kp, lda, v, false);
  }
  if (kc % 2 != 0) {
    __m512i v[V];
    pairs_at(pairs, true, v);
    axpy_step<R, V>(s, a + kc - 1, lda, v, true);
  }
  move_sums<R, V, true>(s, acc, ld_acc);
}

template <int R, bool kFull, From kFrom>
MOEKIT_AVX512_BF16 void axpy(const uint16_t* a, int64_t lda, int64_t kc, const uint16_t* b,
                             int64_t ldb, int64_t cols, float* acc, int64_t ld_acc,
                             const Lines& ahead, uint32_t* panel) {
  Ahead<> pf(ahead, kc / 2);
  axpy_panel<R, 4, kFull, kFrom>(a, lda, kc, b, ldb, cols, acc, ld_acc, pf, panel);
}

// Every panel of a block, in one call: panel(full, c, cols, pf) for the full panels of 16V
// columns (full: std::true_type), then a partial one (std::false_type), c its first column and
// cols its columns; pf prefetching `ahead` over `steps` steps a panel.
template <int V, class Panel>
MOEKIT_AVX512_BF16 inline void each_panel(int64_t cols, int64_t steps, const Lines& ahead,
                                          Panel&& panel) {
  constexpr int64_t kWidth = 16 * V;
  const int64_t full = cols / kWidth;
  Ahead<> pf(ahead, (full + 1) * steps);
  for (int64_t p = 0; p < full; ++p) panel(std::true_type{}, p * kWidth, kWidth, pf);
  if (cols > full * kWidth) panel(std::false_type{}, full * kWidth, cols - full * kWidth, pf);
}

template <int R, int V>
MOEKIT_AVX512_BF16 void axpy_panels(const uint16_t* a, int64_t lda, int64_t kc, const uint16_t* b,
                                    int64_t ldb, int64_t cols, float* acc, int64_t ld_acc,
                                    const Lines& ahead) {
  each_panel<V>(cols, kc / 2, ahead,
                [&](auto full, int64_t c, int64_t n, Ahead<>& pf) MOEKIT_AVX512_BF16 {
                  axpy_panel<R, V, decltype(full)::value, From::kSource>(
                      a, lda, kc, b + c, ldb, n, acc + c, ld_acc, pf, nullptr);
                });
}

// out[r][c] = the sum over k of A[r][k] B[c][k]: 32 bf16 at a time, the tail masked.
template <int R, int C>
MOEKIT_AVX512_BF16 inline void dot_step(__m512 (&s)[R][C], const uint16_t* a, int64_t lda,
                                        const uint16_t* b, int64_t ldb, __mmask32 m) {
  __m512i bv[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) bv[c] = _mm512_maskz_loadu_epi16(m, b + c * ldb);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512i av = _mm512_maskz_loadu_epi16(m, a + r * lda);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) s[r][c] = _mm512_dpbf16_ps(s[r][c], (__m512bh)av, (__m512bh)bv[c]);
  }
}

// The lane sums of 4 vectors, together: (sum v[0], sum v[1], sum v[2], sum v[3]).
MOEKIT_AVX512_BF16 inline __m128 sum4(const __m512 (&v)[4]) {
  // Within each 128-bit lane: pairs of v[0], v[1] and of v[2], v[3] added, then the four
  // vectors' partial sums side by side; then the four lanes added.
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
  const __m512 abcd =
      _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xee));
  const __m256 half =
      _mm256_add_ps(_mm512_castps512_ps256(abcd),
                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

template <int R, int C>
MOEKIT_AVX512_BF16 void dot(const uint16_t* a, int64_t lda, int64_t kc, const uint16_t* b,
                            int64_t ldb, float* out, int64_t ld_out, const Lines& ahead) {
  Ahead<> pf(ahead, kc / 32);
  __m512 s[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) s[r][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= kc; k += 32) {
    pf.step();
    dot_step<R, C>(s, a + k, lda, b + k, ldb, ~__mmask32{0});
  }
  if (k < kc) dot_step<R, C>(s, a + k, lda, b + k, ldb, __mmask32((1u << (kc - k)) - 1));
  if constexpr (C == 4) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm_storeu_ps(out + r * ld_out, sum4(s[r]));
  } else {
    // The R x C sums in row-major order, 4 at a time, the last R C % 4 one by one.
    constexpr int kSums = R * C;
    alignas(16) float four[4];
#pragma GCC unroll 8
    for (int i = 0; i + 4 <= kSums; i += 4) {
      const __m512 v[4] = {s[i / C][i % C], s[(i + 1) / C][(i + 1) % C],
                           s[(i + 2) / C][(i + 2) % C], s[(i + 3) / C][(i + 3) % C]};
      _mm_store_ps(four, sum4(v));
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) out[(i + q) / C * ld_out + (i + q) % C] = four[q];
    }
#pragma GCC unroll 4
    for (int i = kSums / 4 * 4; i < kSums; ++i)
      out[i / C * ld_out + i % C] = _mm512_reduce_add_ps(s[i / C][i % C]);
  }
}

}  // namespace

void axpy_pairs(int rows, const uint16_t* a, int64_t lda, int64_t kc, const uint16_t* b,
                int64_t ldb, int64_t cols, float* acc, int64_t ld_acc, const Lines& ahead,
                uint32_t* panel, PanelUse use) {
  auto run = [&](auto full, auto from) {
    constexpr bool kFull = decltype(full)::value;
    constexpr From kFrom = decltype(from)::value;
    with_rows<kAxpyRows>(rows, [&](auto r) {
      axpy<decltype(r)::value, kFull, kFrom>(a, lda, kc, b, ldb, cols, acc, ld_acc, ahead, panel);
    });
  };
  using F = From;
  if (use == PanelUse::kRead) return run(std::true_type{}, std::integral_constant<F, F::kPanel>{});
  const std::integral_constant<F, F::kSourceStore> store;
  if (cols >= kPanel) return run(std::true_type{}, store);
  return run(std::false_type{}, store);
}

void axpy_pairs_panels(int rows, const uint16_t* a, int64_t lda, int64_t kc, const uint16_t* b,
                       int64_t ldb, int64_t cols, float* acc, int64_t ld_acc, const Lines& ahead) {
  // Up to kAxpyPanelsWideRows rows, panels of 4 vectors; more, 2.
  if (rows <= kAxpyPanelsWideRows) {
    return with_rows<kAxpyPanelsWideRows>(rows, [&](auto r) {
      axpy_panels<decltype(r)::value, 4>(a, lda, kc, b, ldb, cols, acc, ld_acc, ahead);
    });
  }
  with_rows<kAxpyPanelsRows>(rows, [&](auto r) {
    axpy_panels<decltype(r)::value, 2>(a, lda, kc, b, ldb, cols, acc, ld_acc, ahead);
  });
}

namespace {
template <int R, int V, bool kFull>
MOEKIT_AVX512_BF16 inline void axpy_even_odd_panel(const float* af, int64_t ld_af, int64_t kc,
                                                   const uint16_t* b, int64_t ldb, int64_t cols,
                                                   float* acc, int64_t ld_acc, Ahead<>& pf) {
  __mmask32 m[V / 2];
  panel_masks<V>(cols, m);
  __m512 s[R][V];
  move_sums<R, V, false>(s, acc, ld_acc);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t k = 0; k < kc; ++k) {
    if (k % 2 == 0) pf.step();
    const uint16_t* row = b + k * ldb;
    __m512 v[V];
#pragma GCC unroll 2
    for (int h = 0; h < V / 2; ++h) {
      const __m512i x = load_row<kFull>(row + 32 * h, m[h]);
      v[2 * h] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      v[2 * h + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, high));
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 ar = _mm512_set1_ps(af[r * ld_af + k]);
#pragma GCC unroll 4
      for (int i = 0; i < V; ++i) s[r][i] = _mm512_fmadd_ps(ar, v[i], s[r][i]);
    }
  }
  move_sums<R, V, true>(s, acc, ld_acc);
}
template <int R, int V>
MOEKIT_AVX512_BF16 void axpy_even_odd_all(const float* af, int64_t ld_af, int64_t kc,
                                          const uint16_t* b, int64_t ldb, int64_t cols, float* acc,
                                          int64_t ld_acc, const Lines& ahead) {
  each_panel<V>(cols, (kc + 1) / 2, ahead,
                [&](auto full, int64_t c, int64_t n, Ahead<>& pf) MOEKIT_AVX512_BF16 {
                  axpy_even_odd_panel<R, V, decltype(full)::value>(af, ld_af, kc, b + c, ldb, n,
                                                                   acc + c, ld_acc, pf);
                });
}
}  // namespace

void axpy_even_odd_panels(int rows, const float* af, int64_t ld_af, int64_t kc, const uint16_t* b,
                          int64_t ldb, int64_t cols, float* acc, int64_t ld_acc,
                          const Lines& ahead) {
  if (rows <= kAxpyPanelsWideRows) {
    return with_rows<kAxpyPanelsWideRows>(rows, [&](auto r) {
      axpy_even_odd_all<decltype(r)::value, 4>(af, ld_af, kc, b, ldb, cols, acc, ld_acc, ahead);
    });
  }
  with_rows<kAxpyPanelsRows>(rows, [&](auto r) {
    axpy_even_odd_all<decltype(r)::value, 2>(af, ld_af, kc, b, ldb, cols, acc, ld_acc, ahead);
  });
}

bool even_odd_one_chunk() {
  const int forced = even_odd_for_test.load();
  return forced >= 0 ? forced == 1 : cpu_has_amx();
}

void dot_pairs(DotShape shape, int rows, const uint16_t* a, int64_t lda, int64_t kc,
               const uint16_t* b, int64_t ldb, float* out, int64_t ld_out, const Lines& ahead) {
  auto run = [&](auto most_rows, auto cols) {
    with_rows<decltype(most_rows)::value>(rows, [&](auto r) {
      dot<decltype(r)::value, decltype(cols)::value>(a, lda, kc, b, ldb, out, ld_out, ahead);
    });
  };
  using std::integral_constant;
  static_assert(dot_shape(8).rows == 8 && dot_shape(16).rows == 8 && dot_shape(17).rows == 6);
  if (shape.cols == 1) return run(integral_constant<int, 8>{}, integral_constant<int, 1>{});
  if (shape.cols == 2) return run(integral_constant<int, 8>{}, integral_constant<int, 2>{});
  run(integral_constant<int, 6>{}, integral_constant<int, 4>{});
}

MOEKIT_AVX512_BF16 void transpose_pairs(const uint16_t* w, int64_t ldw, int64_t kc, int64_t rows,
                                        uint32_t* panel) {
  const int64_t pairs = (kc + 1) / 2;
  for (int64_t kp0 = 0; kp0 < pairs; kp0 += 16) {
    const int64_t elems = std::min<int64_t>(32, kc - 2 * kp0), tile_pairs = (elems + 1) / 2;
    const __mmask32 m = elems == 32 ? ~__mmask32{0} : __mmask32((1u << elems) - 1);
    for (int g = 0; g < 4; ++g) {
      // r[i]: 16 pairs of weight row 16g + i; transposed, r[k]: pair kp0 + k of the 16 rows.
      __m512i r[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        const int64_t c = 16 * g + i;
        r[i] =
            c < rows ? _mm512_maskz_loadu_epi16(m, w + c * ldw + 2 * kp0) : _mm512_setzero_si512();
      }
      transpose16x16(r);
#pragma GCC unroll 16
      for (int k = 0; k < 16; ++k) {
        if (k < tile_pairs) _mm512_store_si512(panel + (kp0 + k) * kPanel + 16 * g, r[k]);
      }
    }
  }
}

namespace {
// tile[r][32h + i] = (x, y)[idx[i]] for i < 32 (lo for i < 16, hi past it), where x and y are
// acc[r][32h, 32h + 16) and acc[r][32h + 16, 32h + 32), h < 2, r < rows (tile may be acc).
MOEKIT_AVX512_BF16 void permute_halves(int rows, const float* acc, int64_t ld_acc, float* tile,
                                       int64_t ld_tile, __m512i lo, __m512i hi) {
#pragma GCC unroll 8
  for (int r = 0; r < rows; ++r) {
    for (int h = 0; h < 2; ++h) {
      const __m512 x = _mm512_loadu_ps(acc + r * ld_acc + 32 * h),
                   y = _mm512_loadu_ps(acc + r * ld_acc + 32 * h + 16);
      _mm512_storeu_ps(tile + r * ld_tile + 32 * h, _mm512_permutex2var_ps(x, lo, y));
      _mm512_storeu_ps(tile + r * ld_tile + 32 * h + 16, _mm512_permutex2var_ps(x, hi, y));
    }
  }
}
}  // namespace

MOEKIT_AVX512_BF16 void pair_order_to_columns(int rows, const float* acc, int64_t ld_acc,
                                              float* tile, int64_t ld_tile) {
  // Vector 2h + 0 holds, per 128-bit lane q, columns 32h + 8q + [0, 4); vector 2h + 1 columns
  // 32h + 8q + [4, 8): interleaving them 4 lanes at a time restores the order.
  permute_halves(rows, acc, ld_acc, tile, ld_tile,
                 _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23),
                 _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31));
}

MOEKIT_AVX512_BF16 void even_odd_to_columns(int rows, const float* acc, int64_t ld_acc, float* tile,
                                            int64_t ld_tile) {
  // Vector 2h + 0 holds columns 32h + 2L, vector 2h + 1 columns 32h + 2L + 1, L < 16.
  permute_halves(rows, acc, ld_acc, tile, ld_tile,
                 _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23),
                 _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31));
}

}  // namespace stream

HWY_EXPORT(Run);

// The most rows in a local group for which the kernels ran faster than oneDNN, measured on an AMD
// EPYC with AVX512-BF16, 2 threads, the presets' shapes (the bench's groups differ by up to
// +-25%, so its largest group is about 1.25x the mean):
//   - the bf16-pair dot products (the input gradient against [K, n] weights): 256 rows. At 128
//     rows per group on average 1.01-1.19x oneDNN on every preset, at 256 (qwen3, 4096 tokens)
//     1.03x (-6/dlhs-stream.txt); deepseek-v3 at 4096 tokens (128 rows, 160 at most, past the
//     old bound of 160) 1157-1175 ms against oneDNN's 1389-1414
//     (by-hand/dlhs-dot-vs-transposed.txt, by-hand/ab-dlhs-every-dot-item.txt, dlhs-stream.txt).
//     Past 32 rows with a long contraction the transposed pairs run instead (stream::long_dot): at
//     128 rows per group on average gpt-oss-20b 1.16x oneDNN, mixtral-8x7b 1.19x; at 256 0.99x
//     and 1.04x (dlhs-stream.txt);
//   - the f32 dot products: 160 rows, the bound the bf16 ones had (the f32 kernel has not been
//     measured apart);
//   - the bf16-pair kernel of the output-contiguous form (the forward against [K, n] weights):
//     256 rows, whatever a weight row's bytes. Forced, against oneDNN (fwd-stream.txt): at 96-128
//     rows per group on average 1.10-1.22x on every preset (deepseek-v3 at 4096 tokens 1.10x,
//     mixtral-8x7b's 28 KiB rows 1.13x), at 192 (deepseek-v2-lite) 1.08x, at 256 1.00-1.04x
//     (qwen3, olmoe, gpt-oss-20b, mixtral-8x7b), at 384-512 0.99-1.02x. (Before the slabs of
//     kSumsBytes the bound was 48-160 rows by the bytes of a weight row: -6/.)
//   - the f32 kernel of the output-contiguous form: 12 rows, its one chunk on AVX-512 (at 8 rows
//     on average 1.05-1.09x oneDNN on qwen3 and deepseek-v3; at 16, 20 at most, 0.91-0.93x; at 32
//     0.93x; -6/fwd-f32-stream.txt). With its blocks prefetched into L2 (prefetch_into_l1), on an
//     AMD EPYC family 25 model 17 (ragged_dot_small-cpu-2026-11-29/f32-fwd-stream-vs-onednn*.txt),
//     f32 weights: qwen3-30b-a3b 1.50-1.55 / 1.23-1.29 / 1.12-1.14 / 1.01-1.02x at 16 / 24 / 32 /
//     48 rows on average, olmoe-1b-7b 1.62 / 1.15 / 1.05 / 1.02x at 16 / 32 / 48 / 64,
//     deepseek-v3 1.67 / 1.17 / 1.02x at 16 / 32 / 48: 48 rows for f32 weights. bf16 on AVX-512
//     without BF16 (widened into the same kernel) keeps 12: no such CPU measured.
// (The files named: bench/results/ragged_dot_small-cpu-2026-11-26-7/, and -6/ where it says so,
// kCpuStream forced beside oneDNN.)
// bf16 on a CPU without AVX512-BF16 runs the f32 kernels (oneDNN there converts to f32 as
// well): the f32 bounds, but on AVX2 (no AVX-512), where the bf16 kernels widen their operands
// once (F32Rows, SplitRows): the input gradient 384 rows, the forward 256. On AVX2, with the
// prefetches spread by lines (stream::part) and 3 chunks or more multiplying one widened copy of
// a panel, `moekit bench ragged_dot --impl stream --baseline onednn` (AMD EPYC family 23 model 49,
// ragged_dot_small-cpu-2026-11-27-3/stream-vs-onednn-bf16.txt; the largest group about 1.25x the
// average): bf16 forward, qwen3-30b-a3b 1.20 / 1.15 / 1.08 / 1.03 / 1.05 / 0.98 / 0.92x at 64 / 96
// / 128 / 192 / 256 / 384 / 512 rows per group on average, olmoe-1b-7b 1.62 / 1.59 / 1.13x at 128
// / 256 / 384, gpt-oss-20b 1.08 / 0.95x at 128 / 256, mixtral-8x7b 1.01 / 0.85x at 256 / 512;
// input gradient (qwen3) 1.32 / 1.16 / 1.04 / 0.99x at 48 / 64 / 96 / 128 (before those two
// changes, -27-2/: forward 0.99x at 128, input gradient 0.96-0.98x at 64, the bounds 128 and 64);
// then with its items of more than 32 rows on transposed panels (TransposedItem;
// -27-3/stream-vs-onednn-dlhs.txt) 1.11 / 1.14 / 1.08 / 0.99 / 0.95x at 128 / 192 / 256 / 384 /
// 512 rows on average, so 384 in the largest group (about 307 on average); f32 1.00 / 0.94 / 1.01
// / 1.00 / 0.99x at 32 / 48 / 64 / 96 / 128 (level: the bound stays).
// f32 forward 1.01 / 0.87x at 16 / 32 (-27-2/), then with f32 weights in chunks of 6 rows
// (kF32NarrowChunks; -27-6/stream-vs-onednn-f32.txt) 1.26 / 1.19 / 1.12 / 1.09 / 1.01 / 0.94 /
// 0.91x at 16 / 20 / 24 / 28 / 32 / 40 / 48 rows on average (the largest group about 1.25x that),
// so 40 in the largest group; input gradient 1.28 / 1.17 / 1.05 / 0.99 / 0.94x at 16 / 20 / 24 / 28
// / 32 (the bound 32; -27-2/). The choice follows the sizes of the call's local groups, not how
// many of them have rows: an expert-parallel rank (a few local groups) then chooses as the one-rank
// layer (every group) does unless another rank's expert has more than `most` rows, and its experts'
// gradients keep the one-rank layer's bits (LayerEp tests; a count rule broke them). A choice per
// group would close that gap, and would let oneDNN take the calls of few groups of one chunk each,
// where threading inside each matmul ran 3-26% faster (a token or two on mixtral-8x7b or
// gpt-oss-20b). Where oneDNN runs AMX (onednn_runs_amx; an Intel Xeon, 2 cores,
// ragged_dot_small-cpu-2026-11-27-7/, `moekit bench ragged_dot --impl stream` and `--impl onednn`,
// qwen3-30b-a3b, the largest group about 1.25x the average): its bf16 matmuls run at ~1.4 TFLOP/s
// against the pair kernels' ~0.2, and the pair kernels' lead ends at 18 rows per group on average
// (forward 33.8-34.3 / 37.7-41.1 / 47.4 ms against oneDNN's 41.5-41.9 / 42.5-45.4 / 44.5 at 14 / 18
// / 20 rows, input gradient 33.9-35.2 / 37.8-40.3 / 45.5 against 35.9-36.7 / 40.4-40.9 / 40.9): 24
// rows for bf16. Its f32 forward, with no AMX, still runs oneDNN's per-group matmuls slower than
// that AMD machine's: the f32 kernel leads to 48 rows on average (85.0 against 100.0 ms) and trails
// at 64 (110.9 against 100.8): 64 rows; the f32 input gradient's 160 holds (204.4 against 197.0 ms
// at 128 rows on average). The AMX kernel (amx_forward_available: bf16 against [K, n] weights)
// against oneDNN, forced both ways (-7/presets-amx.txt, amx-vs-onednn-large.txt): 1.4-3.0x at 128
// tokens, 1.2-2.1x at 1024, 1.2-1.5x at 4096 on every preset, qwen3-30b-a3b 1.47 / 1.29 / 1.14x at
// 4096 / 8192 / 16384 (256 / 512 / 1024 rows a group): no bound. Its input gradient
// (amx_dot_available: the contraction-contiguous form), qwen3-30b-a3b (-7/dlhs-amx-vs-onednn.txt):
// 1.53-1.69 / 1.27-1.29 / 1.16-1.21x at 1024 / 4096 / 8192 tokens: no bound either. (It trailed
// oneDNN where a group's repacked rows pass L2, gpt-oss-20b and mixtral-8x7b at 4096 tokens
// 0.67-0.78x, until it cut those groups into pieces (kDotRowsBytes): 0.97-1.38x;
// ragged_dot_small-cpu-2026-11-28-2/.)
namespace {
// Whether the f32 kernels run on AVX2: the CPU has no AVX-512.
bool runs_avx2() {
  static const bool avx2 = (hwy::SupportedTargets() & HWY_AVX2) != 0 &&
                           (hwy::SupportedTargets() & (HWY_AVX3 | HWY_AVX3_DL)) == 0;
  return avx2;
}
int64_t stream_most_rows(const RowGroupedGemm& g) {
  const bool amx = onednn_runs_amx();
  // The AMX kernels (ragged_dot_amx.cpp) lead oneDNN at every size measured.
  if (amx_forward_available(g) || amx_dot_available(g)) return std::numeric_limits<int64_t>::max();
  if (g.in_type == DType::kBF16 && stream::has_avx512_bf16()) return amx ? 24 : 256;
  if (g.in_type == DType::kBF16 && runs_avx2()) return g.b_s1 != 1 ? 384 : 256;
  if (runs_avx2()) return g.b_s1 != 1 ? 32 : 40;
  if (g.b_s1 != 1) return 160;
  return amx ? 64 : g.in_type == DType::kF32 ? 48 : 12;
}
}  // namespace

bool stream_picks(const RowGroupedGemm& g) {
  const int64_t most = stream_most_rows(g);
  for (int64_t j = 0; j < g.groups.num_local; ++j) {
    if (g.groups.sizes[g.groups.offset + j] > most) return false;
  }
  return true;
}

Status row_grouped_gemm_stream(const RowGroupedGemm& g) {
  if (!row_edges_done(g)) return {};
  if (g.b_packed) {
    row_grouped_gemm_packed(g);
    return {};
  }
  if (amx_forward_takes(g) || amx_dot_takes(g)) {
    row_grouped_gemm_amx(g);
    return {};
  }
  HWY_DYNAMIC_DISPATCH(Run)(g);
  return {};
}

}  // namespace moekit::detail
#endif  // HWY_ONCE
