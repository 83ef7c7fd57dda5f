// Internal: the CUDA implementations of the two grouped-GEMM problems of ragged_dot_problem.h,
// with the groups in device memory and the stream and workspace in the problem's exec. Included
// by ragged_dot.cpp (host compiler; its table lists them) and the .cu files (nvcc); no CUDA
// header here.
//
// Every implementation runs the same three steps on the caller's stream:
//   1. plan (cuda/plan.cuh): one block reads the device group sizes and offset, clamps them,
//      and writes each local group's rows (and the implementation's own per-group arguments)
//      into the workspace;
//   2. zero: the rows (or, for the weight gradient, the empty groups' matrices) that no GEMM
//      tile writes are set to 0, unless accumulate;
//   3. the grouped GEMM over the local groups only, reading its problem list from the workspace.
// Launch shapes depend only on host-known sizes, never on the group sizes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moekit/ragged_dot.h"
#include "moekit/status.h"
#include "ragged_dot_problem.h"

namespace moekit::detail::cuda {

// The current device's compute capability (major * 10 + minor), multiprocessor count and peak
// memory bandwidth (GB/s, from its memory clock and bus width; 0 where the device reports
// neither), read once per device and cached.
struct DeviceInfo {
  int device, arch, sm_count, mem_gbps;
};
Status device_info(DeviceInfo* out);

// Workspace bytes of the portable implementation, for E_loc local groups.
size_t portable_workspace_size(int64_t num_local);

// Whether the tensor-core implementations take this call: bf16 or f16 inputs, 16-byte aligned
// base pointers, row strides that are multiples of 8 elements, and contracted / output widths
// that are positive multiples of 8 that fit in an int (as every row count must).
bool tensor_core_eligible(const RowGroupedGemm& g);
bool tensor_core_eligible(const ContractionGroupedGemm& g);

Status row_grouped_portable(const RowGroupedGemm& g);
Status contraction_grouped_portable(const ContractionGroupedGemm& g);

// CUTLASS 2.x grouped GEMM (sm80 kernels; run on any device of compute capability >= 8.0).
// CUTLASS 3.x grouped GEMM with TMA and wgmma (sm90a kernels; compute capability 9.0 only), in
// four tile schedules, each its own RaggedDotImpl: sm90 (cooperative, 128x128 tiles; bf16 and
// f16), sm90_pingpong (128x128, one tile per consumer warpgroup), sm90_pingpong64 (the same,
// 64x256) and sm90_coop256 (cooperative, 256x128 tiles on 2x1 clusters), the last three bf16
// only; sm90_pingpong64_runs and sm90_coop256_runs are those two with the tiles dealt to the
// multiprocessors in runs (cuda/tile_runs.h); sm90_workspace_size covers them all.
// Each architecture is compiled when CMAKE_CUDA_ARCHITECTURES names it (MOEKIT_CUDA_SM80,
// MOEKIT_CUDA_SM90 = 1); otherwise the stubs below say so.
#define MOEKIT_CUDA_DECLARE_SCHEDULE(name)            \
  Status row_grouped_##name(const RowGroupedGemm& g); \
  Status contraction_grouped_##name(const ContractionGroupedGemm& g);
#define MOEKIT_CUDA_DECLARE_TC(arch)                                       \
  size_t arch##_workspace_size(int64_t num_local, const DeviceInfo& info); \
  MOEKIT_CUDA_DECLARE_SCHEDULE(arch)
#define MOEKIT_CUDA_STUB_SCHEDULE(name, arch)                                          \
  inline Status row_grouped_##name(const RowGroupedGemm&) {                            \
    return Status::unimplemented("ragged_dot", "built without the " #arch " kernels"); \
  }                                                                                    \
  inline Status contraction_grouped_##name(const ContractionGroupedGemm&) {            \
    return Status::unimplemented("ragged_dot", "built without the " #arch " kernels"); \
  }
#define MOEKIT_CUDA_STUB_TC(arch)                                               \
  inline size_t arch##_workspace_size(int64_t, const DeviceInfo&) { return 0; } \
  MOEKIT_CUDA_STUB_SCHEDULE(arch, arch)

// Whether an sm90 device has an H200's memory bandwidth per multiprocessor (4.8 TB/s over 132
// SMs, 36 GB/s each) rather than an H100 SXM's (3.35 TB/s, 25 GB/s): the two cards kAuto's sm90
// schedules were measured on (both 132 SMs at up to 1980 MHz), which rank the schedules
// differently (bench/results/gpu-h200-2026-11-28/README.md). Cards between or beyond those two
// were not measured; they take the nearer card's rule.
inline bool sm90_bandwidth_rich(const DeviceInfo& info) {
  return info.sm_count > 0 && info.mem_gbps >= 31 * int64_t{info.sm_count};
}

// A row-grouped call's shape as kAuto's sm90 rule sees it (the group sizes are in device memory):
// m rows over `groups` groups, `local_groups` of them on this shard, contraction kc, output
// width n, and whether B's columns are contiguous (b_row_major: rhs [E, K, n] in the forward;
// the input gradient reads it with the contraction contiguous).
struct Sm90RowShape {
  int64_t m, groups, local_groups, kc, n;
  bool b_row_major;
};

// Which sm90 bf16 schedule kAuto runs a row-grouped call (forward, input gradient) on: pingpong
// 128x128, pingpong 64x256 or cooperative 256x128. r = m / groups is the rows per group expected;
// the cooperative 256x128 tiles on long groups need the local groups to hold 16384 rows or more
// (mixtral-8x7b's 8 groups at 4096 tokens lost 5-12% on them on an H100). Each card's clauses
// come from sweeps of the schedules by name beside kAuto, over every preset
// (bench/results/gpu-h100-2026-11-26, gpu-h200-2026-11-28 and gpu-h200-2026-11-29, "Which
// schedule" and "The 64x256 pingpong schedule"):
//   H100 SXM: cooperative 256x128 at r >= 1024 on either layout, or on a long contraction to few
//     columns (kc >= 7168, n <= 2048, r >= 256: deepseek-v3's forward, 1.05x and 1.53x pingpong's
//     rate at 256 and 512 rows a group); pingpong 128x128 otherwise. 64x256 not measured there.
//   H200, either layout: pingpong 64x256 at r <= 256, or at r <= 1024 where the output width n is
//     a multiple of 256 (its tiles full): up to 1.53x faster than the rule before it in the
//     forward and input gradient there, at 41 of its 44 shapes (1024-16384 tokens, every preset;
//     the other 3 1.004-1.044x slower); slower past 1024 rows a group, and from 512 on widths of
//     1408 and 2880 (5.5 and 11.25 tiles of 256). Scored on by-name times (0.906x kAuto's time on
//     average over 60 shapes, the best schedule of each 0.902x), not yet run as kAuto on a GPU.
//   H200, B row-major (the forward), otherwise: cooperative 256x128 at r >= 1024 below 8192
//     columns, or at r >= 6144 (mixtral-8x7b, n = 14336, ran pingpong faster up to 4096 rows a
//     group, cooperative 256x128 1.23x faster at 6144). The H100's deepseek-v3 clause ran 1.19x
//     and 1.55x slower than the 128x128 tiles here.
//   H200, B column-major (the input gradient), otherwise: cooperative 256x128 at r >= 4096 with
//     kc > 2048 only (mixtral-8x7b, gpt-oss-20b); with a contraction of 768-2048 pingpong ran
//     1.13-1.27x faster than cooperative 256x128 at up to 8192 rows a group.
// Returns kCudaSm90Pingpong, kCudaSm90Pingpong64x256 or kCudaSm90Cooperative256.
inline RaggedDotImpl sm90_row_schedule(const Sm90RowShape& s, bool bandwidth_rich) {
  if (s.groups <= 0) return RaggedDotImpl::kCudaSm90Pingpong;
  const int64_t r = s.m / s.groups;
  const bool rows_fill = r * s.local_groups >= 16384;
  bool coop256;
  if (!bandwidth_rich) {
    coop256 = (r >= 1024 && rows_fill) || (s.kc >= 7168 && s.n <= 2048 && r >= 256);
  } else if (r <= 256 || (s.n % 256 == 0 && r <= 1024)) {
    return RaggedDotImpl::kCudaSm90Pingpong64x256;
  } else if (s.b_row_major) {
    coop256 = rows_fill && ((r >= 1024 && s.n < 8192) || r >= 6144);
  } else {
    coop256 = rows_fill && r >= 4096 && s.kc > 2048;
  }
  return coop256 ? RaggedDotImpl::kCudaSm90Cooperative256 : RaggedDotImpl::kCudaSm90Pingpong;
}

// Which sm90 bf16 schedule kAuto runs a contraction-grouped call (the weight gradient: each
// group's [p, q] output in the tiles) on: pingpong on a card with an H200's bandwidth where the
// call has at most 32 groups and fewer than 65536 rows (m), cooperative 256x128 otherwise. On the
// H200 pingpong ran 1.02-1.20x faster there (mixtral-8x7b's 8 groups below 32768 tokens,
// gpt-oss-20b's 32 below 16384), level or slower past it (mixtral 1.07x slower at 65536 rows), and
// with more groups anywhere from 1.12x faster to 1.37x slower (qwen3-30b-a3b's 128 groups,
// deepseek-v3's 256), no clause found that holds over both runs; on the H100 cooperative 256x128
// was the best or within 2% of it at every shape (bench/results/gpu-h200-2026-11-28/rules.py,
// gpu-h100-2026-11-26/README.md).
inline bool sm90_contraction_on_pingpong(int64_t m, int64_t groups, bool bandwidth_rich) {
  return bandwidth_rich && groups > 0 && groups <= 32 && m < 65536;
}

// Tests only: the sm90 run-order schedules take runs of this many tiles (> 0) rather than their
// rule's, so that short test calls run runs longer than one tile; 0 restores the rule.
#if MOEKIT_CUDA_SM90
void set_sm90_run_tiles_for_tests(int run_tiles);
#else
inline void set_sm90_run_tiles_for_tests(int) {}
#endif

#if MOEKIT_CUDA_SM80
MOEKIT_CUDA_DECLARE_TC(sm80)
#else
MOEKIT_CUDA_STUB_TC(sm80)
#endif
#if MOEKIT_CUDA_SM90
MOEKIT_CUDA_DECLARE_TC(sm90)
MOEKIT_CUDA_DECLARE_SCHEDULE(sm90_pingpong)
MOEKIT_CUDA_DECLARE_SCHEDULE(sm90_pingpong64)
MOEKIT_CUDA_DECLARE_SCHEDULE(sm90_coop256)
MOEKIT_CUDA_DECLARE_SCHEDULE(sm90_pingpong64_runs)
MOEKIT_CUDA_DECLARE_SCHEDULE(sm90_coop256_runs)
#else
MOEKIT_CUDA_STUB_TC(sm90)
MOEKIT_CUDA_STUB_SCHEDULE(sm90_pingpong, sm90)
MOEKIT_CUDA_STUB_SCHEDULE(sm90_pingpong64, sm90)
MOEKIT_CUDA_STUB_SCHEDULE(sm90_coop256, sm90)
MOEKIT_CUDA_STUB_SCHEDULE(sm90_pingpong64_runs, sm90)
MOEKIT_CUDA_STUB_SCHEDULE(sm90_coop256_runs, sm90)
#endif

}  // namespace moekit::detail::cuda
