// ragged_dot: a grouped matrix multiply whose rows are grouped by expert, with group_offset so
// that a shard computes only the groups of the experts it holds (SPEC.md section 1). One API for
// every backend: the CPU, and NVIDIA GPUs where moekit was built with CUDA.
//
// Notation: m rows, K contraction size, n output columns, G groups in group_sizes, E_loc groups
// held locally (rhs.shape[0]). start[j] = sum(group_sizes[:j]). Row r belongs to group j when
// start[j] <= r < start[j+1]. Groups group_offset .. group_offset+E_loc-1 are local; local group
// j multiplies by rhs[j - group_offset]. Every other row (non-local groups, and rows at or past
// sum(group_sizes)) is written as exactly 0 and never read, so NaN there cannot leak out.
//
// Where a call runs is where its buffers live, which Exec::device says (moekit/exec.h): the CPU
// (every buffer in host memory), or the current CUDA device (every tensor and the group sizes in
// device memory, and a workspace; the group offset a host value or a device pointer). A CUDA call
// never synchronises with the host and launches the same kernels every time (it can be captured in
// a CUDA graph).
//
// Dtypes: lhs and rhs both f32 or both bf16 (on CUDA also both f16); out f32 or the input dtype.
// Products accumulate in f32 whatever the storage type. Any alignment is taken; on the CPU,
// buffers and row strides in whole 64-byte cache lines read fastest (the input gradient at 32 rows
// a group ran 1.2x slower with the weights 16 bytes off: std::vector's alignment; JAX's buffers
// are 64-byte aligned).
//
// Every call validates what the host can see before it writes anything. Errors name the argument
// and its value: shapes or dtypes that do not match, a null pointer for a non-empty tensor, an
// innermost stride other than 1, G < E_loc, a host group_offset outside [0, G - E_loc], outputs
// overlapping inputs; and on the CPU, where the host reads them, a negative group size or sizes
// summing past m. On CUDA the device values are clamped instead, so that no kernel reads or
// writes out of bounds whatever they hold: a negative size counts as 0, a device offset is
// clamped into [0, G - E_loc], and rows past m drop out of their group.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

#include "moekit/exec.h"
#include "moekit/status.h"
#include "moekit/view.h"

namespace moekit {

// The groups: G sizes and the first local group. Built from anything that views as a span of
// int32 (a span, a vector, an array) and an offset, so that a call reads
// ragged_dot(lhs, rhs, {sizes, offset}, out), or ragged_dot(lhs, rhs, sizes, out) for offset 0.
struct RaggedDotGroups {
  RaggedDotGroups() = default;
  template <typename Sizes>
  requires std::convertible_to<const Sizes&, std::span<const int32_t>> RaggedDotGroups(
      const Sizes& sizes, int32_t offset = 0)  // NOLINT: implicit on purpose
      : sizes(sizes), offset(offset) {}

  std::span<const int32_t> sizes;  // [G] int32, each >= 0, sum <= m; in the call's memory
  int32_t offset = 0;              // the first local group, in [0, G - E_loc]
  // CUDA only: [1] int32 in device memory holding the offset, read (and clamped) on the device
  // in place of `offset`; null: `offset`.
  const int32_t* device_offset = nullptr;
};

// Which implementation runs. kAuto takes the first one in order of preference that takes the
// call: on CUDA the CUTLASS grouped GEMMs on tensor cores (sm90a kernels on compute capability
// 9.0, sm80 kernels on 8.x and later; bf16/f16 inputs with 16-byte aligned pointers and row
// strides, K and n multiples of 8), then a portable kernel. The sm90 kernels come in four tile
// schedules: kCudaSm90 (cooperative, 128x128 tiles), kCudaSm90Pingpong (128x128, each consumer
// warpgroup its own tile), kCudaSm90Pingpong64x256 (the same on 64x256 tiles: fewer wasted rows
// in a group's last tile) and kCudaSm90Cooperative256 (256x128 tiles on clusters of 2), the last
// three for bf16 only. kAuto picks a bf16 call's schedule by its shape and the card (an H100's
// rule and an H200's, told apart by memory bandwidth per multiprocessor): for the forward and
// input gradient cooperative 256x128 where the groups are long (on an H100 about 1024 rows each
// and 16384 in all, or a contraction of 7168+ to at most 2048 columns with 256 rows a group; on
// an H200 longer, by layout), on an H200 pingpong 64x256 up to 256 rows a group, or up to 1024
// on an output width that is a multiple of 256, pingpong 128x128 otherwise; the weight gradient
// on cooperative 256x128 but for few groups of few rows on an H200 (pingpong), as measured
// (src/cuda/grouped_gemm_cuda.h); f16 on kCudaSm90. RaggedDotOptions::ran
// says which one ran. On the CPU, for the forward and input gradient with few rows in every local
// group (outside the batch-invariant mode; the bound
// depends on the dtype and the layout, as measured), kCpuStream, which streams each group's
// weights once with the rows' sums in registers (asked for by name it takes any group sizes); for
// the weight gradient with at most 16 rows in every local group (outside that mode), kCpuStream's
// sums of outer products, which write each group's gradient with non-temporal stores; and oneDNN
// for everything else (on packed weights, RaggedDotOptions::rhs_packed, kCpuStream always).
// kReference is the
// CPU's scalar reference the tests compare against (slow; for checking only). Naming an
// implementation that cannot take the call is an error that says what it needs.
enum class RaggedDotImpl {
  kAuto,
  kOneDnn,
  kReference,
  kCudaSm90,
  kCudaSm80,
  kCudaPortable,
  kCpuStream,
  kCudaSm90Pingpong,
  kCudaSm90Cooperative256,
  kCudaSm90Pingpong64x256,
  // kCudaSm90Pingpong64x256 and kCudaSm90Cooperative256 with the output tiles dealt to the
  // multiprocessors in runs of consecutive tiles (a multiprocessor's next tile mostly in the same
  // group) rather than one at a time; by name only (kAuto never picks them) until measured.
  kCudaSm90Pingpong64x256Runs,
  kCudaSm90Cooperative256Runs,
};
// The implementation's name, as moekit bench's --impl takes it and the errors say it ("auto",
// "onednn", "reference", "sm90", "sm80", "portable", "stream", "sm90-pingpong",
// "sm90-cooperative-256", "sm90-pingpong-64x256", "sm90-pingpong-64x256-runs",
// "sm90-cooperative-256-runs"); "unknown" for a value outside the enum.
const char* impl_name(RaggedDotImpl impl);

struct RaggedDotOptions {
  // rhs is [E_loc, n, K] (a linear layer's [out, in] per expert) instead of [E_loc, K, n]. On
  // the CPU each pass streams the weights fastest along its own contraction: the forward on
  // [E_loc, n, K], the input gradient on [E_loc, K, n] (qwen3-30b-a3b, bf16, an Intel Xeon with
  // AMX: the forward 1.1-1.6x faster at 8-256 rows a group, the input gradient 1.1-1.5x slower at
  // 32-128; bench/results/ragged_dot_small-cpu-2026-11-28-5). Weights used for inference only
  // run fastest stored [E_loc, n, K].
  bool rhs_transposed = false;
  // rhs is packed (pack_ragged_rhs, below), for the pass that reads it: the forward's weights
  // packed, packed_rhs_shape(E_loc, K, n, dtype) (bf16 [E_loc, ceil(n / 32), 64 * ceil(K / 2)],
  // f32 [E_loc, ceil(n / 32), 32 * K]); the input gradient's their transpose packed,
  // packed_rhs_shape(E_loc, n, K, dtype) (pack_ragged_rhs with rhs_transposed the opposite of the
  // weights' layout: frozen weights, a second copy). Not the weight gradient; on host buffers,
  // with rhs_transposed false (the packed form is the same whichever layout it was packed from);
  // kCpuStream and kReference take it (kAuto: kCpuStream).
  bool rhs_packed = false;
  // Add into the existing output instead of overwriting it. Forward and input gradient: rows
  // outside the local groups are left untouched (so shards can sum into one buffer). Weight
  // gradient: d_rhs += the new gradient; empty groups left untouched.
  bool accumulate = false;
  // Batch invariance: each row of the forward's and the input gradient's output is the same bits
  // whatever the other rows are (its group's size, the other groups, m, the offset) and however
  // many threads run; the weight gradient sums each group's rows in one order fixed by their
  // positions in the group, so the same rows give the same bits. Off by default (it costs speed
  // where it gives up threading inside one matmul). CPU only (oneDNN and the reference; the
  // reference is invariant in either mode); a CUDA call with it is refused.
  bool batch_invariant = false;
  RaggedDotImpl impl = RaggedDotImpl::kAuto;
  // If set, receives the implementation that runs the call (kAuto's choice, or the one named),
  // before it runs; left as it was when the call is refused before that.
  RaggedDotImpl* ran = nullptr;
};

// Forward.
//   lhs          [m, K]                                  f32 | bf16
//   rhs          [E_loc, K, n]  ([E_loc, n, K] if rhs_transposed), same dtype as lhs; or, with
//                rhs_packed, as packed_rhs_shape(E_loc, K, n, lhs dtype) (pack_ragged_rhs)
//   groups       [G] sizes, G >= E_loc, and the offset
//   out          [m, n]                                  f32 | lhs dtype
// With offset 0 and E_loc = G this is jax.lax.ragged_dot(lhs, rhs, group_sizes).
Status ragged_dot(ConstTensorView lhs, ConstTensorView rhs, const RaggedDotGroups& groups,
                  TensorView out, const RaggedDotOptions& options = {}, const Exec& exec = {});

// Weights packed for the CPU's forward, for inference, where the weights are packed once and
// used many times. Each panel of 32 output columns holds its whole contraction front to back, one
// 32-bit word a column at a time: in bf16 two contraction rows as a pair, in f32 one. Element
// (j, k, c) of the [E_loc, K, n] weights goes to
//   bf16:  packed[j][c / 32][64 * (k / 2) + 2 * (c % 32) + k % 2]
//   f32:   packed[j][c / 32][32 * k + c % 32]
// and zeros where k >= K or c >= n. The forward then reads each panel once, in order, with every
// row's sums in registers from its first element to its last, and each thread's panels as one
// sequential stream. On weight rows too long for a block of them and the rows' sums to stay in a
// core's caches, the [E_loc, K, n] and [E_loc, n, K] forwards read them in short runs or move the
// sums through L2 at 4-16 rows a group: on mixtral-8x7b's gate|up ([4096, 28672] bf16, an AMD
// EPYC with AVX512-BF16) the forward on this layout ran 1.44-1.61x faster there, and 0.98-1.55x
// the unpacked weights' kAuto on four presets' shapes at 1-2048 tokens
// (bench/results/ragged_dot_small-cpu-2026-11-29-5). For the input gradient through weights that
// do not change (frozen experts), pack their transpose as well: pack_ragged_rhs(w, packed_t,
// {.rhs_transposed = true}) reads [E_loc, K, n] weights as [E_loc, n' = K, K' = n] and writes
// packed_rhs_shape(E_loc, n, K), which ragged_dot_dlhs reads with rhs_packed (from [E_loc, n, K]
// weights, rhs_transposed false).
//   rhs          [E_loc, K, n]  ([E_loc, n, K] if options.rhs_transposed)   bf16 | f32, host memory
//   packed       packed_rhs_shape(E_loc, K, n, rhs dtype), rhs dtype,        host memory
Status pack_ragged_rhs(ConstTensorView rhs, TensorView packed, const RaggedDotOptions& options = {},
                       const Exec& exec = {});
// The shape pack_ragged_rhs writes for E_loc groups of [K, n] weights of `dtype`: bf16 [E_loc,
// ceil(n / 32), 64 * ceil(K / 2)], f32 [E_loc, ceil(n / 32), 32 * K]; {-1, -1, -1} where a size
// is negative, the element count passes int64 or the dtype is neither.
struct PackedRhsShape {
  int64_t dims[3];
};
PackedRhsShape packed_rhs_shape(int64_t num_local_groups, int64_t K, int64_t n,
                                DType dtype = DType::kBF16);

// Input gradient: d_lhs = ragged_dot(d_out, rhs^T) with the same groups and offset; 0 on
// non-local rows (untouched with accumulate).
//   d_out        [m, n]                                  f32 | bf16
//   rhs          as in the forward (options.rhs_transposed says its layout), dtype of d_out; or,
//                with rhs_packed, rhs^T packed: packed_rhs_shape(E_loc, n, K, d_out dtype)
//   d_lhs        [m, K]                                  f32 | d_out dtype
Status ragged_dot_dlhs(ConstTensorView d_out, ConstTensorView rhs, const RaggedDotGroups& groups,
                       TensorView d_lhs, const RaggedDotOptions& options = {},
                       const Exec& exec = {});

// Weight gradient ("ragged contracting"): for each local group j,
// d_rhs[j - offset] = lhs[rows of j]^T @ d_out[rows of j]; exactly 0 for an empty group.
//   lhs          [m, K]                                  f32 | bf16
//   d_out        [m, n]                                  same dtype as lhs
//   d_rhs        [E_loc, K, n]  ([E_loc, n, K] if rhs_transposed)   f32 | lhs dtype
Status ragged_dot_drhs(ConstTensorView lhs, ConstTensorView d_out, const RaggedDotGroups& groups,
                       TensorView d_rhs, const RaggedDotOptions& options = {},
                       const Exec& exec = {});

// Bytes of workspace (Exec::workspace) any call on `device` with E_loc = num_local_groups needs (on
// CUDA, for the current device; 0 on the CPU, or on CUDA in a build without it).
size_t ragged_dot_workspace_size(Device device, int64_t num_local_groups);

// 2 * (rows of the local groups) * K * n: the useful FLOPs of any of the three calls. Local
// groups past the end of group_sizes count 0 rows. -1 for a negative argument or group size, or
// a count past int64.
int64_t ragged_dot_flops(std::span<const int32_t> group_sizes, int32_t group_offset,
                         int64_t num_local_groups, int64_t K, int64_t n);

}  // namespace moekit
