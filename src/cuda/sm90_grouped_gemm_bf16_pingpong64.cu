// The sm90 grouped GEMM with bf16 inputs on the pingpong schedule, 64x256 tiles
// (RaggedDotImpl::kCudaSm90Pingpong64x256; see sm90_grouped_gemm.cu).
#include "cuda/sm90_grouped_gemm.cuh"

namespace moekit::detail::cuda::tc {
MOEKIT_TC_INSTANTIATE(sm90::KernelPingpong64, cutlass::bfloat16_t)
}  // namespace moekit::detail::cuda::tc
