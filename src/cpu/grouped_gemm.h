// Internal: the CPU implementations of the two grouped-GEMM problems of ragged_dot_problem.h,
// and the helpers they share. The group sizes are in host memory, checked by check_groups.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu/convert.h"
#include "moekit/dtype.h"
#include "moekit/status.h"
#include "ragged_dot_problem.h"

namespace moekit::detail {

// Scalar references (src/cpu/ragged_dot_ref.cpp): plain loops, f32 accumulation, no threads.
Status row_grouped_gemm_ref(const RowGroupedGemm& g);
Status contraction_grouped_gemm_ref(const ContractionGroupedGemm& g);

// oneDNN (src/cpu/ragged_dot_onednn.cpp): one cached runtime-dimension matmul per group.
Status row_grouped_gemm_onednn(const RowGroupedGemm& g);
Status contraction_grouped_gemm_onednn(const ContractionGroupedGemm& g);
// Whether oneDNN's matmuls run on AMX on this CPU (its effective ISA, DNNL_MAX_CPU_ISA included).
bool onednn_runs_amx();

// Few rows per group (src/cpu/ragged_dot_stream.cpp): each group's weights streamed once; and
// whether it runs faster than oneDNN on a call (by its largest local group, as measured).
Status row_grouped_gemm_stream(const RowGroupedGemm& g);
bool stream_picks(const RowGroupedGemm& g);
// The weight gradient where every local group holds few rows (src/cpu/ragged_dot_outer.cpp):
// sums of outer products, written with non-temporal stores; kAuto picks it (outside the
// batch-invariant mode) where no local group holds more than kOuterMostRows rows.
inline constexpr int64_t kOuterMostRows = 16;
Status contraction_grouped_gemm_stream(const ContractionGroupedGemm& g);
bool contraction_stream_picks(const ContractionGroupedGemm& g);
// kCpuStream's forward on packed weights (RowGroupedGemm::b_packed; src/cpu/ragged_dot_packed.cpp),
// its rows and contraction not empty (row_edges_done first). set_packed_pairs_for_test(0) runs
// the Highway kernels on a CPU with AVX512-BF16 too, -1 gives the choice back to the CPU.
void row_grouped_gemm_packed(const RowGroupedGemm& g);
void set_packed_pairs_for_test(int mode);
// Its blocks of a panel's contraction, in steps (a panel row of 128 bytes: one contraction row in
// f32, a pair in bf16), where a group's rows read a panel more than once and the panel is longer
// than 4 blocks (half of L2): an eighth of a core's L2 of `l2_bytes` (512 KiB where the machine
// does not say, l2_bytes <= 0), at least 64 steps.
// ragged_dot_packed.cpp gives the measurements. set_packed_block_steps_for_test sets the steps the
// calls use (0: the machine's).
int64_t packed_block_steps(int64_t l2_bytes);
void set_packed_block_steps_for_test(int64_t steps);
namespace stream {
// Whether this CPU runs the bf16-pair kernels (AVX512-BF16).
bool has_avx512_bf16();
}  // namespace stream
// The attribute that compiles a function for those kernels (called where has_avx512_bf16 says).
#define MOEKIT_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))
// kCpuStream's forward on AMX (src/cpu/ragged_dot_amx.cpp): whether it can take a call (bf16 rows
// against [K, n] weights, b_s1 1, on a CPU with AMX-BF16 whose OS grants the tiles), whether it
// takes it (a local group of 8 rows or more; fewer run the even/odd kernels), and the call (its
// rows and contraction not empty: row_edges_done first). set_amx_for_test(false) keeps such calls
// on the other kernels (the tests of each Highway target), true gives them back.
bool amx_forward_available(const RowGroupedGemm& g);
bool amx_forward_takes(const RowGroupedGemm& g);
// The same for the contraction-contiguous form (the input gradient against [K, n] weights: b_s0
// 1), whose tiles compute C's transpose from the weights as they lie.
bool amx_dot_available(const RowGroupedGemm& g);
bool amx_dot_takes(const RowGroupedGemm& g);
// Either form, as its b_s1 says.
void row_grouped_gemm_amx(const RowGroupedGemm& g);
void set_amx_for_test(bool allowed);
// Whether the CPU has AMX-BF16 (CPUID; whether the OS grants the tiles aside).
bool cpu_has_amx();
// kCpuStream's one chunk of rows on bf16 weights, on a CPU with AVX512-BF16: the even/odd kernels
// (1) or the pair kernels (0) whatever the CPU, or as the CPU says (-1: even/odd where it has AMX;
// ragged_dot_stream.cpp gives the measurements).
void set_even_odd_for_test(int mode);
// The AMX input gradient's cache budgets (ragged_dot_amx.cpp: kDotRowsBytes, kDotMinPieceRows,
// kDotSpanPieceRows, kDotSumsBytes), smaller in tests so that small calls take its pieces and
// spans; 0 restores one.
void set_amx_dot_budgets_for_test(int64_t rows_bytes, int64_t min_piece_rows,
                                  int64_t span_piece_rows, int64_t sums_bytes);
// kCpuStream's output-contiguous form (the forward against [K, n] weights), groups of one chunk of
// rows: each is cut into `slabs` slabs of columns and `parts` parts of the contraction (one of
// them 1), for `busy` groups with rows on `threads` threads, weight rows of `row_bytes` and a
// contraction of kc. Whole, unless the groups are fewer than the threads (then parts, enough for
// every thread, each of 64 contraction rows at least) or the threads do not divide their count
// (then slabs to even them, each slab's run of a weight row at least 8 KiB);
// ragged_dot_stream.cpp gives the measurements.
struct OneChunkSplit {
  int64_t slabs, parts;
};
OneChunkSplit one_chunk_split(int64_t busy, int64_t threads, int64_t row_bytes, int64_t kc);
// The same form's groups of one chunk on bf16 weight rows past 32 KiB go in slabs of columns whose
// f32 sums take at most this many bytes: a quarter of a core's L2 of `l2_bytes`, within [128 KiB,
// 1 MiB]; 128 KiB where the machine does not say (l2_bytes <= 0). ragged_dot_stream.cpp gives the
// measurements. set_stream_wide_sums_for_test sets the budget the calls use (0: the machine's).
int64_t wide_sums_budget(int64_t l2_bytes);
void set_stream_wide_sums_for_test(int64_t bytes);
// The same form's blocks of weight rows with one chunk of rows: 8 rows, or a multiple of 8 whose
// rows of `row_bytes` fill at most half of a core's L1 data cache of `l1d_bytes` (8 where the
// machine does not say, l1d_bytes <= 0). On an Intel Xeon with 48 KiB of L1d, qwen3-30b-a3b's
// 1.5 KiB rows in blocks of 16 rows (24 KiB) ran its forward at 2-32 tokens 1.03-1.18x faster
// than in blocks of 8, 1 token level; 3-5.6 KiB rows (8 rows either way) level with 16
// (bench/results/ragged_dot_small-cpu-2026-11-28-6). On an AMD EPYC's 32 KiB it stays 8 there,
// as measured best on it (ragged_dot_stream.cpp). Rows under 1.5 KiB (the router's matmul, under
// 0.1% of the layer) take blocks of the same bytes: not timed.
int64_t one_chunk_block_rows(int64_t row_bytes, int64_t l1d_bytes);
// The same, for the pair kernels (bf16 on AVX512-BF16) and a group of `rows` rows: 1-2 rows as
// one_chunk_block_rows; from 3 rows on, that (twice past 5 rows) and at least 128 KiB of rows
// (kBlockBytes), which go into L2 as they are prefetched (prefetch_into_l1). Each kernel call
// loads and stores a panel's sums once per block: on blocks of 8 rows that ran the calls at 86-129
// GFLOP/s on one core of an AMD EPYC family 25 model 17 at 3-11 rows, 139-193 on blocks of 42
// (weights in L1/L2, 1.5 KiB rows). There (32 KiB L1d), A/B in one loop, weights cold, bf16
// forward (bench/results/ragged_dot_small-cpu-2026-11-29-2/ab-final.txt, ab-explore-*.txt):
// qwen3-30b-a3b with rows spread evenly at 3 / 4 / 5 / 6 / 8 / 11 rows a group 1.24 / 1.29 / 1.56
// / 1.31 / 1.21 / 1.24x (earlier runs 1.17-1.33 / 1.23-1.36 / 1.34-1.38x at 3-5), routed at 4 /
// 8 rows on average 1.48 / 1.26x, at 1.5-2.5 0.91-1.06x (its rows of 1-3: 2 rows alone, level
// 0.97-1.00x, keep their blocks); deepseek-v3 at 5.5 / 11 rows 1.19 / 1.20x, 3-4 level
// (0.97-1.18x over runs); the layer's gate|up and down shapes at 2-8 rows (qwen3-30b-a3b,
// gpt-oss-20b, deepseek-v2-lite, olmoe-1b-7b) 1.00-1.19x; mixtral-8x7b's 32 KiB slabs (blocks
// of 8-16 rows either way) level. kMinBlockRows (64 rows), as several chunks take, made 2 MiB
// blocks of those slabs: 0.71x. Not measured on the Xeon (48 KiB L1d; the even/odd kernels take
// its one-chunk groups).
int64_t one_chunk_pair_block_rows(int64_t rows, int64_t row_bytes, int64_t l1d_bytes);
// The same form's groups of 1-2 rows on f32 weights, on AVX-512: whether their sums, `rows` rows
// of `cols` columns, are few enough (kRowMajorSumsBytes, 6 KiB) for the row-major kernel (each
// weight row of a block read front to back, the sums added to in L1) rather than the panels (a
// few columns of every row of the block at a time, the sums in registers).
// ragged_dot_stream.cpp gives the measurements.
bool one_chunk_row_major(int64_t rows, int64_t cols);
// The contraction-contiguous form's dot products: whether a chunk's rows, `chunk_bytes` of them as
// one kernel call reads them (its rows times a span, or their whole length), stay in an L1 data
// cache of `l1d_bytes` (32 KiB where the machine does not say) beside the weight rows streaming
// through it: at most three quarters of it. The shapes of one or two weight rows a call (few rows
// a group) read the chunk's rows again for every weight row; where they do not stay in L1 those
// reads go to L2, and the chunks of 6 rows against 4 weight rows (a quarter of the reads per
// product) run faster. ragged_dot_stream.cpp (DotItem) gives the measurements.
bool dot_chunk_fits_l1(int64_t chunk_bytes, int64_t l1d_bytes);

// kCpuStream's kernels: whether the next block of weights goes into L1 as it is prefetched, or
// into L2 (the kernels load it from there): into L1 only where it fits beside the block at hand
// (twice a block's bytes within the L1 data cache of `l1d_bytes`, 32 KiB where the machine does
// not say). A block prefetched into an L1 that cannot hold both evicts the lines the kernel is
// using (the block at hand, the pairs the first chunk leaves, the rows of A), which then come
// back from L2 as the loads wait. So only the one-chunk forward's blocks (sized by L1:
// one_chunk_block_rows; on the pair kernels those of 1-2 rows) ask; the others (about
// kBlockBytes; on AVX2 the chunk-major blocks of 32-48 rows) go into L2. This replaces the f32
// kernels' half-ahead (items of 1-2 rows on weight rows past 2 KiB prefetched half the next block,
// measured on an AMD EPYC family 23 model 49 with every block into L1: 1.02-1.22x there,
// bench/results/ragged_dot_small-cpu-2026-11-27-6/), which served exactly the blocks that do not
// fit L1 twice: into L2 they go whole (on the family 25 model 17, whole against half in one loop,
// twice: qwen3-30b-a3b's f32 forward at one row a group 1.06-1.24x, the input gradient 0.92-1.17x;
// ragged_dot_small-cpu-2026-11-29/ab-f32-one-chunk.txt). On an AMD EPYC family 25 model 17 (32 KiB
// of L1), A/B in one loop against every block into L1, twice
// (bench/results/ragged_dot_small-cpu-2026-11-29/ab-prefetch-level*.txt), bf16: qwen3-30b-a3b's
// forward 1.18-1.25x at 16 rows a group (256 tokens), 1.03-1.14x at 32-64, 0.98-1.14x at 1-8;
// its input gradient 1.11-1.65x at 2-16 rows, 0.93-1.18x at 1, 0.91-1.01x at 24-64 (and one
// 0.80x whose repeat read 0.98x); deepseek-v3's forward 1.08-1.43x at every count from 1 to 1024
// tokens, its input gradient 1.22-1.84x at 128-512 tokens (4-16 rows), 0.90-1.20x at
// 1-64, 1.04-1.06x at 1024; the layer's gate|up shapes at 1-64 tokens: mixtral-8x7b 1.04-1.45x,
// gpt-oss-20b 1.02-1.73x, olmoe-1b-7b 0.91-1.57x, deepseek-v2-lite 1.06-1.80x; f32
// (qwen3) 1.18-1.74x at 4-16 rows, 0.88-1.38x at 1-2, 0.98-1.11x at 32-64. Not measured on the
// Xeon with AMX (48 KiB of L1: its AMX kernels prefetch on their own, its one-chunk blocks of 1-5
// rows stay in L1, twice 24 KiB) nor on an AVX2 CPU (the AMD EPYC family 23's f32 kernels).
bool prefetch_into_l1(int64_t block_bytes, int64_t l1d_bytes);

// Sets rows [begin, end) of a [rows, n] matrix with row stride ld to zero.
inline void zero_rows(void* base, DType t, int64_t ld, int64_t n, int64_t begin, int64_t end) {
  const size_t es = dtype_size(t);
  auto* p = static_cast<char*>(base);
#pragma omp parallel for schedule(static) if ((end - begin) * n > (1 << 16))
  for (int64_t r = begin; r < end; ++r) std::memset(p + r * ld * es, 0, n * es);
}

// The rows [begin, end) that the local groups take together.
struct RowRange {
  int64_t begin, end;
};
inline RowRange local_rows(const Groups& g) {
  int64_t begin = 0;
  for (int64_t j = 0; j < g.offset; ++j) begin += g.sizes[j];
  int64_t end = begin;
  for (int64_t j = 0; j < g.num_local; ++j) end += g.sizes[g.offset + j];
  return {begin, end};
}

// The row problem's parts that need no product: rows outside the local groups set to 0 (unless
// accumulating), and with an empty contraction every local row too. Returns whether products
// remain to compute (local rows, columns and a contraction).
inline bool row_edges_done(const RowGroupedGemm& g) {
  const RowRange local = local_rows(g.groups);
  if (!g.accumulate) {
    zero_rows(g.c, g.out_type, g.ldc, g.n, 0, local.begin);
    zero_rows(g.c, g.out_type, g.ldc, g.n, local.end, g.m);
  }
  if (g.n == 0 || local.end == local.begin) return false;
  if (g.kc == 0) {  // empty contraction: the product is 0
    if (!g.accumulate) zero_rows(g.c, g.out_type, g.ldc, g.n, local.begin, local.end);
    return false;
  }
  return true;
}

}  // namespace moekit::detail
