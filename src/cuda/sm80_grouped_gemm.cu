// The sm80 entry points of grouped_gemm_cuda.h. The kernels are instantiated per input dtype in
// sm80_grouped_gemm_bf16.cu and sm80_grouped_gemm_f16.cu.
#include "cuda/sm80_grouped_gemm.cuh"

namespace moekit::detail::cuda {

namespace tc {
MOEKIT_TC_EXTERN(sm80::Kernel, cutlass::bfloat16_t)
MOEKIT_TC_EXTERN(sm80::Kernel, cutlass::half_t)
}  // namespace tc

size_t sm80_workspace_size(int64_t num_local, const DeviceInfo& info) {
  return tc::workspace_size_any<sm80::Kernel>(num_local, info);
}

Status row_grouped_sm80(const RowGroupedGemm& g) {
  DeviceInfo info;
  MOEKIT_RETURN_IF_ERROR(device_info(&info));
  return tc::row_grouped_any<sm80::Kernel>(g, g.groups, g.exec, info);
}

Status contraction_grouped_sm80(const ContractionGroupedGemm& g) {
  DeviceInfo info;
  MOEKIT_RETURN_IF_ERROR(device_info(&info));
  return tc::contraction_grouped_any<sm80::Kernel>(g, g.groups, g.exec, info);
}

}  // namespace moekit::detail::cuda
