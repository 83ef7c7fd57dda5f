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

// The device's compute capability (major * 10 + minor) and multiprocessor count, read once per
// device and cached; the current device's when device < 0.
struct DeviceInfo {
  int device, arch, sm_count;
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
// three tile schedules, each its own RaggedDotImpl: sm90 (cooperative, 128x128 tiles; bf16 and
// f16), sm90_pingpong (128x128, one tile per consumer warpgroup) and sm90_coop256 (cooperative,
// 256x128 tiles on 2x1 clusters), the last two bf16 only; sm90_workspace_size covers all three.
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

// Which sm90 bf16 schedule kAuto runs a row-grouped call (forward, input gradient) on: cooperative
// 256x128 tiles, or pingpong 128x128. From the call's shape only (the group sizes are in device
// memory): rows per group expected r = m / groups, and r * local_groups rows in the local ones.
// Cooperative 256x128 where the groups are long and the call has rows enough to fill the SMs with
// its larger tiles (r >= 1024, 16384 rows at least), or on a long contraction to few columns
// (kc >= 7168, n <= 2048, r >= 256: deepseek-v3's forward, 1.05x and 1.53x pingpong's rate at 256
// and 512 rows a group; why so much more there than elsewhere was not measured); pingpong
// otherwise. From one sweep of the three schedules over every preset, 2048-16384 tokens, on an
// H100 (bench/results/gpu-h100-2026-11-26/README.md, "Which schedule").
inline bool sm90_rows_on_cooperative256(int64_t m, int64_t groups, int64_t local_groups, int64_t kc,
                                        int64_t n) {
  if (groups <= 0) return false;
  const int64_t r = m / groups;
  return (r >= 1024 && r * local_groups >= 16384) || (kc >= 7168 && n <= 2048 && r >= 256);
}

#if MOEKIT_CUDA_SM80
MOEKIT_CUDA_DECLARE_TC(sm80)
#else
MOEKIT_CUDA_STUB_TC(sm80)
#endif
#if MOEKIT_CUDA_SM90
MOEKIT_CUDA_DECLARE_TC(sm90)
MOEKIT_CUDA_DECLARE_SCHEDULE(sm90_pingpong)
MOEKIT_CUDA_DECLARE_SCHEDULE(sm90_coop256)
#else
MOEKIT_CUDA_STUB_TC(sm90)
MOEKIT_CUDA_STUB_SCHEDULE(sm90_pingpong, sm90)
MOEKIT_CUDA_STUB_SCHEDULE(sm90_coop256, sm90)
#endif

}  // namespace moekit::detail::cuda
