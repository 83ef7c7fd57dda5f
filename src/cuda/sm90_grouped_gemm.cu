// The sm90 entry points of grouped_gemm_cuda.h. The kernels are instantiated per input dtype in
// sm90_grouped_gemm_bf16.cu and sm90_grouped_gemm_f16.cu.
#include "cuda/sm90_grouped_gemm.cuh"

namespace moekit::detail::cuda {

namespace tc {
MOEKIT_TC_EXTERN(sm90::Kernel, cutlass::bfloat16_t)
MOEKIT_TC_EXTERN(sm90::Kernel, cutlass::half_t)
}  // namespace tc

size_t sm90_workspace_size(int64_t num_local, const DeviceInfo& info) {
  return tc::workspace_size_any<sm90::Kernel>(num_local, info);
}

Status row_grouped_sm90(const RowGroupedGemm& g, const DeviceGroups& groups, const CudaExec& exec,
                        const DeviceInfo& info) {
  return tc::row_grouped_any<sm90::Kernel>(g, groups, exec, info);
}

Status contraction_grouped_sm90(const ContractionGroupedGemm& g, const DeviceGroups& groups,
                                const CudaExec& exec, const DeviceInfo& info) {
  return tc::contraction_grouped_any<sm90::Kernel>(g, groups, exec, info);
}

}  // namespace moekit::detail::cuda
