// The sm90 grouped GEMM kernels with bf16 inputs (f32 or bf16 out).
#include "cuda/sm90_grouped_gemm.cuh"

namespace moekit::detail::cuda::tc {
MOEKIT_TC_INSTANTIATE(sm90::Kernel, cutlass::bfloat16_t)
}  // namespace moekit::detail::cuda::tc
