// A tuning candidate of the sm90 grouped GEMM with bf16 inputs: pingpong, 128x128 tiles
// (MOEKIT_CUDA_SM90_KERNEL selects it; see sm90_grouped_gemm.cu).
#include "cuda/sm90_grouped_gemm.cuh"

namespace moekit::detail::cuda::tc {
MOEKIT_TC_INSTANTIATE(sm90::KernelPingpong, cutlass::bfloat16_t)
}  // namespace moekit::detail::cuda::tc
