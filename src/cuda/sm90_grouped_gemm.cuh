// Internal (nvcc, sm_90a only): CUTLASS 3.x grouped GEMM for Hopper. TMA loads, wgmma on a
// warp-specialised persistent kernel, a per-group problem list that the plan kernel writes on
// the device: the host never sees the group sizes, and the grid is one CTA per multiprocessor
// (cluster) whatever they are. The kernel families of tc_grouped_gemm.cuh, one per Config;
// instantiated per input dtype in sm90_grouped_gemm_<dtype>*.cu.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>

#include <algorithm>
#include <cstdint>
#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <type_traits>

#include "cuda/grouped_gemm_cuda.h"
#include "cuda/plan.cuh"
#include "cuda/sm90_run_scheduler.cuh"
#include "cuda/tc_grouped_gemm.cuh"
#include "cuda/tile_runs.h"

namespace moekit::detail::cuda::sm90 {

using Shape3 = cute::Shape<int, int, int>;  // (M, N, K)
// The per-group shapes in device memory, with the tiles dealt one at a time (CUTLASS's group
// scheduler) or in runs (sm90_run_scheduler.cuh).
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape3>;
using RunOrdered = RunOrderedProblemShape<Shape3>;

// A cute stride of CUTLASS's grouped layouts has one run-time element among its first two
// modes (the leading dimension), the others static (1 and the unused batch stride 0).
template <class Stride>
__device__ Stride leading(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_static_v<cute::tuple_element_t<0, Stride>>) {
    cute::get<1>(s) = ld;
  } else {
    cute::get<0>(s) = ld;
  }
  return s;
}

// The run length the tests asked for (> 0), or 0: the rule (tile_runs.h's run_length).
// sm90_grouped_gemm.cu holds it (grouped_gemm_cuda.h's set_sm90_run_tiles_for_tests).
int sm90_run_tiles_for_tests();

// A kernel configuration: CTA tile (M, N, K), cluster shape, and the mainloop and epilogue
// schedules (cooperative: the two consumer warpgroups split each tile; pingpong: each takes a
// tile of its own, one's epilogue overlapping the other's mainloop).
template <class Tile, class Cluster, class MainloopSchedule, class EpilogueSchedule>
struct Config {
  using TileShape = Tile;
  using ClusterShape = Cluster;
  using KernelSchedule = MainloopSchedule;
  using EpiSchedule = EpilogueSchedule;
};

using Cooperative128x128 = Config<cute::Shape<cute::_128, cute::_128, cute::_64>,
                                  cute::Shape<cute::_1, cute::_1, cute::_1>,
                                  cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                                  cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
using Cooperative256x128Cluster2x1 =
    Config<cute::Shape<cute::_256, cute::_128, cute::_64>,
           cute::Shape<cute::_2, cute::_1, cute::_1>,
           cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
           cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
using Pingpong128x128 = Config<cute::Shape<cute::_128, cute::_128, cute::_64>,
                               cute::Shape<cute::_1, cute::_1, cute::_1>,
                               cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                               cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
// The same area as 128x128 in half the rows: a group's last tile wastes fewer rows where groups
// hold a few hundred (qwen3-30b-a3b at 4096 tokens, 256 +- 25% rows a group: 80% of the 128-row
// tiles' rows are real, 89% of the 64-row tiles'; bench/results/gpu-tiles-2026-11-28/).
using Pingpong64x256 =
    Config<cute::Shape<cute::_64, cute::_256, cute::_64>, cute::Shape<cute::_1, cute::_1, cute::_1>,
           cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
           cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;

// One grouped GEMM: D_j [M_j, N] (+)= A_j [M_j, K_j] @ B_j [K_j, N], f32 accumulation, D row-major
// (C is D itself, read only when beta = 1). LayoutA / LayoutB are CUTLASS's tags for A (M x K)
// and B (K x N): RowMajor or ColumnMajor. Shapes: ProblemShape (CUTLASS's order of tiles) or
// RunOrdered (runs of tiles, sm90_run_scheduler.cuh).
template <class Cfg, class TIn, class TOut, class LayoutA, class LayoutB,
          class Shapes = ProblemShape>
struct KernelWith {
  using TileShape = typename Cfg::TileShape;
  using ClusterShape = typename Cfg::ClusterShape;
  static constexpr int kAlignIn = 16 / sizeof(TIn);
  static constexpr int kAlignOut = 16 / sizeof(TOut);

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, TOut,
      cutlass::layout::RowMajor*, kAlignOut, TOut, cutlass::layout::RowMajor*, kAlignOut,
      typename Cfg::EpiSchedule,
      cutlass::epilogue::fusion::LinearCombination<TOut, float>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TIn, LayoutA*, kAlignIn, TIn, LayoutB*,
      kAlignIn, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      typename Cfg::KernelSchedule>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shapes, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideC = typename GemmKernel::InternalStrideC;
  using StrideD = typename GemmKernel::InternalStrideD;
  using ElementA = typename Gemm::ElementA;
  using ElementB = typename Gemm::ElementB;
  using ElementD = typename Gemm::EpilogueOutputOp::ElementOutput;
  static constexpr const char* kOp = "ragged_dot (CUDA, sm90)";

  // The per-group arrays in the workspace, after the plan; then CUTLASS's own workspace.
  struct Arrays {
    Shape3* shapes;
    const ElementA** a;
    const ElementB** b;
    const ElementD** c;
    ElementD** d;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideC* stride_c;
    StrideD* stride_d;
    void* cutlass_workspace;

    // Group j: D [m, n] (+)= A [m, k] @ B [k, n], each with its leading dimension.
    __device__ void set(int64_t j, int m, int n, int k, const ElementA* a, int64_t lda,
                        const ElementB* b, int64_t ldb, ElementD* d, int64_t ldd) const {
      shapes[j] = Shape3(m, n, k);
      this->a[j] = a;
      this->b[j] = b;
      c[j] = d;
      this->d[j] = d;
      stride_a[j] = leading<StrideA>(lda);
      stride_b[j] = leading<StrideB>(ldb);
      stride_c[j] = leading<StrideC>(ldd);
      stride_d[j] = leading<StrideD>(ldd);
    }
  };

  static Arrays arrays_in(void* workspace, int64_t num_local) {
    WorkspaceCursor cursor(workspace, num_local);
    Arrays r;
    r.shapes = cursor.take<Shape3>(num_local);
    r.a = cursor.take<const ElementA*>(num_local);
    r.b = cursor.take<const ElementB*>(num_local);
    r.c = cursor.take<const ElementD*>(num_local);
    r.d = cursor.take<ElementD*>(num_local);
    r.stride_a = cursor.take<StrideA>(num_local);
    r.stride_b = cursor.take<StrideB>(num_local);
    r.stride_c = cursor.take<StrideC>(num_local);
    r.stride_d = cursor.take<StrideD>(num_local);
    r.cutlass_workspace = reinterpret_cast<void*>(cursor.position());
    return r;
  }

  static constexpr bool kRunOrdered = std::is_same_v<Shapes, RunOrdered>;
  // The problem-shape type picks the scheduler (sm90_run_scheduler.cuh's selector).
  static_assert(kRunOrdered ==
                std::is_same_v<typename GemmKernel::TileScheduler, RunScheduler<RunOrdered, 8>>);

  // The run length (tile_runs.h) for a call of this shape on this device, unless a test set one
  // (sm90_run_tiles_for_tests); 1 on CUTLASS's order.
  static int run_tiles(const tc::CallShape& call, const DeviceInfo& info) {
    if constexpr (!kRunOrdered) {
      return 1;
    } else {
      if (const int forced = sm90_run_tiles_for_tests(); forced > 0) return forced;
      constexpr int tm = cute::size<0>(TileShape{}), tn = cute::size<1>(TileShape{});
      constexpr int cm = cute::size<0>(ClusterShape{}), cn = cute::size<1>(ClusterShape{});
      const uint64_t clusters = static_cast<uint64_t>(std::max(1, info.sm_count / (cm * cn)));
      return static_cast<int>(
          run_length(expected_units(call.m_total, call.m_each, call.groups, call.n, tm, tn, cm, cn),
                     clusters));
    }
  }

  static typename Gemm::Arguments arguments(const Arrays& w, int64_t num_local, bool accumulate,
                                            const DeviceInfo& info, const tc::CallShape& call) {
    cutlass::KernelHardwareInfo hw;
    hw.device_id = info.device;
    hw.sm_count = info.sm_count;
    Shapes shapes;
    shapes.num_groups = static_cast<int>(num_local);
    shapes.problem_shapes = w.shapes;
    shapes.host_problem_shapes = nullptr;  // no host shapes: read on the device
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                  shapes,
                                  {w.a, w.stride_a, w.b, w.stride_b},
                                  {{}, w.c, w.stride_c, w.d, w.stride_d},
                                  hw};
    // The tile scheduler's swizzle (CTAs take tiles in blocks this many wide) stays at 1: 2, 4
    // and 8 ran within noise of it over every preset at 4096-65536 tokens on an H200, no setting
    // ahead in all passes of any preset (bench/results/gpu-h200-2026-11-27/README.md).
    args.scheduler.max_swizzle_size = 1;
    if constexpr (kRunOrdered) args.scheduler.run_tiles = run_tiles(call, info);
    auto& fusion = args.epilogue.thread;
    fusion.alpha = 1.0f;
    fusion.beta = accumulate ? 1.0f : 0.0f;  // beta = 0: C is never read
    fusion.alpha_ptr = nullptr;
    fusion.beta_ptr = nullptr;
    return args;
  }

  static size_t workspace_size(int64_t num_local, const DeviceInfo& info) {
    const Arrays w = arrays_in(nullptr, num_local);
    const size_t ours = reinterpret_cast<uintptr_t>(w.cutlass_workspace);
    return ours + align_up(Gemm::get_workspace_size(
                      arguments(w, num_local, false, info, tc::CallShape{})));
  }

  static Status run(const Arrays& w, int64_t num_local, bool accumulate, const DeviceInfo& info,
                    const tc::CallShape& call, cudaStream_t stream) {
    return tc::launch<Gemm>(kOp, arguments(w, num_local, accumulate, info, call),
                            w.cutlass_workspace, stream);
  }
};

// The families, as tc_grouped_gemm.cuh takes them: RaggedDotImpl::kCudaSm90 (bf16 and f16),
// kCudaSm90Cooperative256, kCudaSm90Pingpong and kCudaSm90Pingpong64x256 (bf16), and the run
// order's candidates kCudaSm90Pingpong64x256Runs and kCudaSm90Cooperative256Runs (bf16; by name
// until a GPU has timed them beside the others).
template <class TIn, class TOut, class LayoutA, class LayoutB>
using Kernel = KernelWith<Cooperative128x128, TIn, TOut, LayoutA, LayoutB>;
template <class TIn, class TOut, class LayoutA, class LayoutB>
using KernelCoop256 = KernelWith<Cooperative256x128Cluster2x1, TIn, TOut, LayoutA, LayoutB>;
template <class TIn, class TOut, class LayoutA, class LayoutB>
using KernelPingpong = KernelWith<Pingpong128x128, TIn, TOut, LayoutA, LayoutB>;
template <class TIn, class TOut, class LayoutA, class LayoutB>
using KernelPingpong64 = KernelWith<Pingpong64x256, TIn, TOut, LayoutA, LayoutB>;

template <class TIn, class TOut, class LayoutA, class LayoutB>
using KernelPingpong64Runs = KernelWith<Pingpong64x256, TIn, TOut, LayoutA, LayoutB, RunOrdered>;
template <class TIn, class TOut, class LayoutA, class LayoutB>
using KernelCoop256Runs =
    KernelWith<Cooperative256x128Cluster2x1, TIn, TOut, LayoutA, LayoutB, RunOrdered>;

}  // namespace moekit::detail::cuda::sm90
