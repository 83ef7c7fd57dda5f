// Internal (nvcc, sm_90a only): a tile scheduler for CUTLASS 3.x's sm90 grouped (ptr-array)
// kernels that deals runs of consecutive tiles to the persistent clusters (cuda/tile_runs.h says
// the order and why), in place of CUTLASS's group scheduler, which deals them one at a time.
//
// The sm90 ptr-array kernels take only their own group scheduler (GroupScheduler), which
// TileSchedulerSelector picks by the problem-shape type. RunOrderedProblemShape is CUTLASS's
// GroupProblemShape under a type of its own, and the specialisation below maps it to
// RunScheduler: a kernel built on RunOrderedProblemShape runs the run order, the same kernel on
// GroupProblemShape CUTLASS's. Only the order changes: each cluster still takes whole output
// tiles (no split-K), the grid is one CTA a multiprocessor (its clusters whole), and the group
// sizes stay in device memory (the host never sees them).
//
// How it works: every warp finds its CTA's first tile itself (initial_work_tile_info); the
// kernel's scheduler warp then walks the CTA's later tiles and hands them through a shared-memory
// pipeline to the producer and consumer warps (advance_to_next_work / fetch_next_work), as with
// CUTLASS's scheduler. A walk moves a cursor forward over the groups, 32 at a time (one lane
// each, a warp prefix sum of their tile counts), since a cluster's units only grow.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include <cstdint>
#include <cute/arch/cluster_sm90.hpp>
#include <cute/tensor.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>
#include <cutlass/kernel_hardware_info.hpp>
#include <cutlass/pipeline/pipeline.hpp>

#include "cuda/tile_runs.h"

namespace moekit::detail::cuda::sm90 {

// CUTLASS's grouped problem shape (the per-group (M, N, K) in device memory), asking for the
// run order.
template <class Shape>
struct RunOrderedProblemShape : cutlass::gemm::GroupProblemShape<Shape> {};

template <class GroupShape, int Stages>
class RunScheduler {
 public:
  using ProblemShape = typename GroupShape::UnderlyingProblemShape;

  // What the scheduler warp hands the others: an output tile (M_idx, N_idx in tiles) of group
  // L_idx, or no tile (the CTA is done).
  struct WorkTileInfo {
    int32_t M_idx = 0;
    int32_t N_idx = 0;
    int32_t L_idx = 0;
    int32_t is_valid_tile = 0;

    CUTLASS_HOST_DEVICE bool is_valid() const { return is_valid_tile != 0; }
    CUTLASS_HOST_DEVICE static WorkTileInfo invalid_work_tile() { return {-1, -1, -1, 0}; }
    CUTLASS_HOST_DEVICE bool is_final_split(uint32_t) const { return true; }
    CUTLASS_HOST_DEVICE int32_t reduction_subtile_idx() const { return -1; }
  };
  using SchedulerResponse = WorkTileInfo;

  using Pipeline = cutlass::PipelineAsync<Stages>;
  using PipelineStorage = typename Pipeline::SharedStorage;
  using PipelineState = typename Pipeline::PipelineState;

  // The kernels read and write a raster order and a swizzle; the run order has neither (it is
  // along M within a group, unswizzled), so they only pass through.
  enum class RasterOrder { AlongM, AlongN };
  enum class RasterOrderOptions { Heuristic, AlongM, AlongN };

  struct Arguments {
    int max_swizzle_size = 1;
    RasterOrderOptions raster_order = RasterOrderOptions::AlongM;
    // Consecutive tiles a cluster takes (tile_runs.h's run_length); 1 is CUTLASS's order.
    int run_tiles = 1;
  };

  struct Params {
    GroupShape problem_shapes{};
    int32_t tile_m = 1, tile_n = 1, cluster_m = 1, cluster_n = 1;
    uint32_t run_tiles = 1;
    int32_t log_swizzle_size_ = 0;
    RasterOrder raster_order_ = RasterOrder::AlongM;
  };

  template <class TileShape, class ClusterShape>
  static Params to_underlying_arguments(GroupShape problem_shapes, TileShape, ClusterShape,
                                        cutlass::KernelHardwareInfo const&, Arguments const& args,
                                        void* = nullptr, uint32_t = 1, uint32_t = 1) {
    static_assert(cute::is_static<TileShape>::value && cute::is_static<ClusterShape>::value);
    Params p;
    p.problem_shapes = problem_shapes;
    p.tile_m = cute::size<0>(TileShape{});
    p.tile_n = cute::size<1>(TileShape{});
    p.cluster_m = cute::size<0>(ClusterShape{});
    p.cluster_n = cute::size<1>(ClusterShape{});
    p.run_tiles = args.run_tiles < 1 ? 1u : static_cast<uint32_t>(args.run_tiles);
    return p;
  }

  // The clusters a grid of one CTA a multiprocessor holds (at least one).
  static int clusters_for(cutlass::KernelHardwareInfo const& hw, int cluster_size) {
    int q = hw.sm_count / cluster_size;
    if (hw.max_active_clusters > 0 && hw.max_active_clusters < q) q = hw.max_active_clusters;
    return q < 1 ? 1 : q;
  }

  // Clusters along x (cluster_m CTAs each) and cluster_n CTAs along y.
  template <class TileShape, class ClusterShape>
  static dim3 get_grid_shape(Params const&, GroupShape const&, TileShape, ClusterShape,
                             cutlass::KernelHardwareInfo hw, Arguments, bool = true) {
    const int cm = cute::size<0>(ClusterShape{});
    const int cn = cute::size<1>(ClusterShape{});
    return dim3(static_cast<unsigned>(cm * clusters_for(hw, cm * cn)), static_cast<unsigned>(cn),
                1);
  }

  static bool can_implement(Arguments const& args) { return args.run_tiles >= 1; }

  template <class Shape, class ElementAccumulator>
  static size_t get_workspace_size(Arguments const&, Shape, cutlass::KernelHardwareInfo const&,
                                   uint32_t, uint32_t = 1, uint32_t = 1) {
    return 0;
  }
  template <class Shape, class ElementAccumulator>
  static cutlass::Status initialize_workspace(Arguments const&, void*, cudaStream_t, Shape,
                                              cutlass::KernelHardwareInfo const&, uint32_t,
                                              uint32_t = 1, uint32_t = 1,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  RunScheduler() = default;

  CUTLASS_DEVICE RunScheduler(Params const& params, SchedulerResponse* response)
      : params_(params), response_(response) {
#if defined(__CUDA_ARCH__)
    order_.clusters = gridDim.x / static_cast<uint32_t>(params.cluster_m);
    order_.run = params.run_tiles;
    cluster_ = blockIdx.x / static_cast<uint32_t>(params.cluster_m);
#endif
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return work_at(0);
  }

  template <class TileSchedulerPipeline, class TileSchedulerPipelineState>
  CUTLASS_DEVICE auto advance_to_next_work(TileSchedulerPipeline& pipeline,
                                           TileSchedulerPipelineState state,
                                           uint32_t advance_count = 1) {
    step_ += advance_count;
    const WorkTileInfo work = work_at(step_);
    pipeline.producer_acquire(state);
    if (cute::elect_one_sync()) {
      response_[state.index()] = work;
      cutlass::arch::fence_view_async_shared();
      pipeline.producer_commit(state);
    }
    return cute::make_tuple(work, true);
  }

  template <class TileSchedulerPipeline, class TileSchedulerPipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo, TileSchedulerPipeline& pipeline,
                                      TileSchedulerPipelineState state) {
    pipeline.consumer_wait(state);
    const WorkTileInfo work = response_[state.index()];
    cutlass::arch::fence_view_async_shared();
    pipeline.consumer_release(state);
    return cute::make_tuple(work, true);
  }

  // Whole tiles only: no split-K, no reduction, every CTA writes its tile's epilogue.
  CUTLASS_HOST_DEVICE static bool compute_epilogue(WorkTileInfo const&, Params const&) {
    return true;
  }
  template <class FrgTensorC>
  CUTLASS_DEVICE static void fixup(Params const&, WorkTileInfo const&, FrgTensorC&, uint32_t,
                                   uint32_t) {}
  CUTLASS_DEVICE static bool valid_warpgroup_in_work_tile(WorkTileInfo const&) { return true; }

  template <class ProblemShapeMNKL, class TileShape>
  CUTLASS_HOST_DEVICE static int get_work_k_tile_count(WorkTileInfo const&,
                                                       ProblemShapeMNKL problem_shape,
                                                       TileShape tile_shape) {
    return cute::size(cute::ceil_div(cute::get<2>(problem_shape), cute::get<2>(tile_shape)));
  }
  CUTLASS_HOST_DEVICE static uint32_t get_work_k_tile_start(WorkTileInfo const&) { return 0u; }

 private:
  // The group holding the units [start, start + units): group g, `along_m` cluster tiles along M.
  struct Cursor {
    int32_t group = -1;
    uint64_t start = 0, units = 0, along_m = 1;
  };

  CUTLASS_DEVICE uint64_t units_of(int32_t g, uint64_t* along_m) const {
    const ProblemShape s = params_.problem_shapes.get_problem_shape(g);
    *along_m = cluster_tiles(cute::get<0>(s), params_.tile_m, params_.cluster_m);
    return *along_m * cluster_tiles(cute::get<1>(s), params_.tile_n, params_.cluster_n);
  }

  // Moves the cursor to the group holding unit u (u never below the cursor's start). All 32
  // lanes of the warp call it with the same u and cursor. False past the last group.
  CUTLASS_DEVICE bool seek(uint64_t u) {
    const int lane = cutlass::canonical_lane_idx();
    const int32_t groups = params_.problem_shapes.groups();
    while (u >= cursor_.start + cursor_.units) {
      if (cursor_.group + 1 >= groups) return false;
      // Lane l looks at group cursor.group + 1 + l.
      const int32_t g = cursor_.group + 1 + lane;
      uint64_t along_m = 1;
      const uint64_t units = g < groups ? units_of(g, &along_m) : 0;
      uint64_t before_end = units;  // inclusive prefix sum over the lanes
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const uint64_t up = __shfl_up_sync(0xffffffffu, before_end, d);
        if (lane >= d) before_end += up;
      }
      const uint64_t base = cursor_.start + cursor_.units;
      const uint32_t hit = __ballot_sync(0xffffffffu, g < groups && u < base + before_end);
      const int from = hit ? __ffs(hit) - 1 : 31;
      cursor_.group = __shfl_sync(0xffffffffu, g, from);
      cursor_.units = __shfl_sync(0xffffffffu, units, from);
      cursor_.along_m = __shfl_sync(0xffffffffu, along_m, from);
      cursor_.start = base + __shfl_sync(0xffffffffu, before_end, from) - cursor_.units;
    }
    return true;
  }

  CUTLASS_DEVICE WorkTileInfo work_at(uint64_t step) {
    const uint64_t u = order_.unit(cluster_, step);
    if (!seek(u)) return WorkTileInfo::invalid_work_tile();
    const ClusterTile t = cluster_tile_of(u - cursor_.start, cursor_.along_m);
    const dim3 in_cluster = cute::block_id_in_cluster();
    return {static_cast<int32_t>(t.m * params_.cluster_m + in_cluster.x),
            static_cast<int32_t>(t.n * params_.cluster_n + in_cluster.y), cursor_.group, 1};
  }

  Params params_{};
  SchedulerResponse* response_ = nullptr;
  TileRuns order_{1, 1};
  uint64_t cluster_ = 0;
  uint64_t step_ = 0;
  Cursor cursor_{};
};

}  // namespace moekit::detail::cuda::sm90

// The sm90 kernels' scheduler for RunOrderedProblemShape: CUTLASS picks its group scheduler by
// this selector, and this partial specialisation is more specialised than its own.
namespace cutlass::gemm::kernel::detail {
template <class TileShape, class ClusterShape, uint32_t Stages, class Shape>
struct TileSchedulerSelector<GroupScheduler, arch::Sm90, TileShape, ClusterShape, Stages,
                             moekit::detail::cuda::sm90::RunOrderedProblemShape<Shape>> {
  using Scheduler = moekit::detail::cuda::sm90::RunScheduler<
      moekit::detail::cuda::sm90::RunOrderedProblemShape<Shape>, static_cast<int>(Stages)>;
};
}  // namespace cutlass::gemm::kernel::detail
