// Internal (nvcc only): the steps every CUDA grouped GEMM shares. The plan kernel turns the
// device group sizes and offset into each local group's rows, the zero kernels write the parts
// of the output that no GEMM tile covers, and the workspace layout puts both where the GEMM
// reads them. See grouped_gemm_cuda.h for the order of the steps.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <string>

#include "cuda/grouped_gemm_cuda.h"
#include "cuda/launch.cuh"
#include "cuda/plan_math.h"
#include "moekit/status.h"

namespace moekit::detail::cuda {

// Per-device caches (device_info, occupancy) hold this many devices; others query every call.
inline constexpr int kMaxCachedDevices = 64;

// The plan in the workspace, first thing in it:
//   bounds [2]      the local row range [local_begin, local_end), clipped to m
//   begin  [E_loc]  first row of local group j
//   rows   [E_loc]  rows of local group j (0 for an empty group, or one clipped away)
// followed, from plan_bytes() on, by the implementation's own arguments.
struct Plan {
  int64_t* bounds;
  int64_t* begin;
  int64_t* rows;
};

constexpr size_t plan_bytes(int64_t num_local) {
  return align_up(sizeof(int64_t) * static_cast<size_t>(2 + 2 * num_local));
}

inline Plan plan_in(void* workspace, int64_t num_local) {
  auto* p = static_cast<int64_t*>(workspace);
  return Plan{p, p + 2, p + 2 + num_local};
}

// Hands out the implementation's arrays, 256-byte aligned one after the other from
// plan_bytes() on (a null workspace gives the offsets, for sizing).
class WorkspaceCursor : public Carve {
 public:
  WorkspaceCursor(void* workspace, int64_t num_local) : Carve(workspace, plan_bytes(num_local)) {}
};

inline Status check_workspace(const char* op, const Exec& exec, size_t need) {
  return check_workspace(op, exec, need, "ragged_dot_workspace_size(Device::kCuda, E_loc)");
}

inline constexpr int kPlanThreads = 256;

// One block. Groups [0, offset + E_loc) are scanned in chunks of kPlanThreads with a running
// carry; emit(j, begin, rows) writes local group j's implementation arguments.
template <class Emit>
__global__ void __launch_bounds__(kPlanThreads)
    plan_kernel(Groups groups, int64_t m, Plan plan, Emit emit) {
  using Scan = cub::BlockScan<int64_t, kPlanThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const int64_t num_local = groups.num_local;
  const int64_t offset =
      clamp_group_offset(groups.device_offset != nullptr ? *groups.device_offset : groups.offset,
                         groups.count, num_local);
  const int64_t last = offset + num_local;  // one past the last local group
  if (num_local == 0 && threadIdx.x == 0) plan.bounds[0] = plan.bounds[1] = 0;
  int64_t carry = 0;  // rows of the groups before this chunk
  for (int64_t base = 0; base < last; base += kPlanThreads) {
    const int64_t g = base + threadIdx.x;
    const int64_t size = g < last ? clamp_group_size(groups.sizes[g]) : 0;
    int64_t start, chunk_rows;
    Scan(scan_storage).ExclusiveSum(size, start, chunk_rows);
    start += carry;
    if (g >= offset && g < last) {
      const int64_t j = g - offset;
      const RowRange r = clip_rows(start, size, m);
      plan.begin[j] = r.begin;
      plan.rows[j] = r.end - r.begin;
      emit(j, r.begin, r.end - r.begin);
      if (j == 0) plan.bounds[0] = r.begin;
      if (j == num_local - 1) plan.bounds[1] = r.end;
    }
    carry += chunk_rows;
    __syncthreads();  // scan_storage is reused by the next chunk
  }
}

// An emitter that writes nothing beyond the plan (the portable kernels read the plan only).
struct EmitNothing {
  __device__ void operator()(int64_t, int64_t, int64_t) const {}
};

// Step 2: sets to 0 what no GEMM tile of the problem writes (common.cu). Row-grouped: the rows
// of C outside [bounds[0], bounds[1]), those of non-local groups and past sum(group_sizes).
// Contraction-grouped: the [p, q] matrices C_j of the local groups j with no rows.
Status zero_uncovered(const char* op, const RowGroupedGemm& g, int64_t num_local, const Plan& plan,
                      cudaStream_t stream);
Status zero_uncovered(const char* op, const ContractionGroupedGemm& g, int64_t num_local,
                      const Plan& plan, cudaStream_t stream);

// Steps 1 and 2 of every implementation: the plan (with `emit`), then the zeros (none when
// accumulating: the untouched parts keep their contents).
template <class Problem, class Emit>
Status plan_and_zero(const char* op, const Problem& g, const Groups& groups, void* workspace,
                     const Emit& emit, cudaStream_t stream) {
  const Plan plan = plan_in(workspace, groups.num_local);
  plan_kernel<<<1, kPlanThreads, 0, stream>>>(groups, g.m, plan, emit);
  MOEKIT_RETURN_IF_ERROR(launch_status(op, "the plan kernel"));
  if (g.accumulate) return {};
  return zero_uncovered(op, g, groups.num_local, plan, stream);
}

}  // namespace moekit::detail::cuda
