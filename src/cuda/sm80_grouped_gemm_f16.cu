// The sm80 grouped GEMM kernels with f16 inputs (f32 or f16 out).
#include "cuda/sm80_grouped_gemm.cuh"

namespace moekit::detail::cuda::tc {
MOEKIT_TC_INSTANTIATE(sm80::Kernel, cutlass::half_t)
}  // namespace moekit::detail::cuda::tc
