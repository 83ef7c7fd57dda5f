// The sm80 grouped GEMM kernels with bf16 inputs (f32 or bf16 out).
#include "cuda/sm80_grouped_gemm.cuh"

namespace moekit::detail::cuda::tc {
MOEKIT_TC_INSTANTIATE(sm80::Kernel, cutlass::bfloat16_t)
}  // namespace moekit::detail::cuda::tc
