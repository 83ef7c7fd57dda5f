// The sm90 entry points of grouped_gemm_cuda.h: four tile schedules of one CUTLASS 3.x kernel
// (sm90_grouped_gemm.cuh), each a RaggedDotImpl of its own, and two of them again on the run
// order of tiles (sm90_run_scheduler.cuh). The cooperative 128x128 kernels are instantiated for
// bf16 and f16 (sm90_grouped_gemm_bf16.cu, _f16.cu), the pingpong (128x128 and 64x256) and the
// cooperative 256x128 ones for bf16 only (sm90_grouped_gemm_bf16_pingpong.cu, _pingpong64.cu,
// _coop256.cu, _pingpong64_runs.cu, _coop256_runs.cu);
// ragged_dot.cpp's tables say which one kAuto runs for which call.
#include <algorithm>
#include <atomic>
#include <type_traits>

#include "cuda/sm90_grouped_gemm.cuh"

namespace moekit::detail::cuda {

namespace tc {
MOEKIT_TC_EXTERN(sm90::Kernel, cutlass::bfloat16_t)
MOEKIT_TC_EXTERN(sm90::Kernel, cutlass::half_t)
MOEKIT_TC_EXTERN(sm90::KernelCoop256, cutlass::bfloat16_t)
MOEKIT_TC_EXTERN(sm90::KernelPingpong, cutlass::bfloat16_t)
MOEKIT_TC_EXTERN(sm90::KernelPingpong64, cutlass::bfloat16_t)
MOEKIT_TC_EXTERN(sm90::KernelPingpong64Runs, cutlass::bfloat16_t)
MOEKIT_TC_EXTERN(sm90::KernelCoop256Runs, cutlass::bfloat16_t)
}  // namespace tc

namespace {

using BF16 = cutlass::bfloat16_t;
std::atomic<int> g_run_tiles_for_tests{0};

// A call on one of the bf16-only schedules (the table's predicate keeps other dtypes away; this
// guards a direct call).
template <template <class, class, class, class> class KernelT, class Problem>
Status run_bf16(const Problem& g) {
  if (g.in_type != DType::kBF16) {
    return Status::unimplemented("ragged_dot (CUDA, sm90)",
                                 "this sm90 tile schedule is built for bf16 only");
  }
  DeviceInfo info;
  MOEKIT_RETURN_IF_ERROR(device_info(&info));
  if constexpr (std::is_same_v<Problem, RowGroupedGemm>) {
    return tc::row_grouped<KernelT, BF16>(g, g.groups, g.exec, info);
  } else {
    return tc::contraction_grouped<KernelT, BF16>(g, g.groups, g.exec, info);
  }
}

}  // namespace

void set_sm90_run_tiles_for_tests(int run_tiles) { g_run_tiles_for_tests.store(run_tiles); }
int sm90::sm90_run_tiles_for_tests() { return g_run_tiles_for_tests.load(); }

size_t sm90_workspace_size(int64_t num_local, const DeviceInfo& info) {
  return std::max({tc::workspace_size_any<sm90::Kernel>(num_local, info),
                   tc::workspace_size<sm90::KernelCoop256, BF16>(num_local, info),
                   tc::workspace_size<sm90::KernelPingpong, BF16>(num_local, info),
                   tc::workspace_size<sm90::KernelPingpong64, BF16>(num_local, info),
                   tc::workspace_size<sm90::KernelPingpong64Runs, BF16>(num_local, info),
                   tc::workspace_size<sm90::KernelCoop256Runs, BF16>(num_local, info)});
}

Status row_grouped_sm90(const RowGroupedGemm& g) {
  DeviceInfo info;
  MOEKIT_RETURN_IF_ERROR(device_info(&info));
  return tc::row_grouped_any<sm90::Kernel>(g, g.groups, g.exec, info);
}

Status contraction_grouped_sm90(const ContractionGroupedGemm& g) {
  DeviceInfo info;
  MOEKIT_RETURN_IF_ERROR(device_info(&info));
  return tc::contraction_grouped_any<sm90::Kernel>(g, g.groups, g.exec, info);
}

// The bf16-only schedules' two entry points each (grouped_gemm_cuda.h's
// MOEKIT_CUDA_DECLARE_SCHEDULE).
#define MOEKIT_SM90_BF16_SCHEDULE(name, KernelT)                                            \
  Status row_grouped_##name(const RowGroupedGemm& g) { return run_bf16<sm90::KernelT>(g); } \
  Status contraction_grouped_##name(const ContractionGroupedGemm& g) {                      \
    return run_bf16<sm90::KernelT>(g);                                                      \
  }
MOEKIT_SM90_BF16_SCHEDULE(sm90_pingpong, KernelPingpong)
MOEKIT_SM90_BF16_SCHEDULE(sm90_pingpong64, KernelPingpong64)
MOEKIT_SM90_BF16_SCHEDULE(sm90_coop256, KernelCoop256)
MOEKIT_SM90_BF16_SCHEDULE(sm90_pingpong64_runs, KernelPingpong64Runs)
MOEKIT_SM90_BF16_SCHEDULE(sm90_coop256_runs, KernelCoop256Runs)
#undef MOEKIT_SM90_BF16_SCHEDULE

}  // namespace moekit::detail::cuda
