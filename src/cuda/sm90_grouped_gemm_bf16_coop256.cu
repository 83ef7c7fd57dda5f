// The sm90 grouped GEMM with bf16 inputs on the cooperative schedule, 256x128 tiles on 2x1
// clusters (RaggedDotImpl::kCudaSm90Cooperative256; see sm90_grouped_gemm.cu).
#include "cuda/sm90_grouped_gemm.cuh"

namespace moekit::detail::cuda::tc {
MOEKIT_TC_INSTANTIATE(sm90::KernelCoop256, cutlass::bfloat16_t)
}  // namespace moekit::detail::cuda::tc
