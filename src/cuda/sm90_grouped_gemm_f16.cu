// The sm90 grouped GEMM kernels with f16 inputs (f32 or f16 out).
#include "cuda/sm90_grouped_gemm.cuh"

namespace moekit::detail::cuda::tc {
MOEKIT_TC_INSTANTIATE(sm90::Kernel, cutlass::half_t)
}  // namespace moekit::detail::cuda::tc
