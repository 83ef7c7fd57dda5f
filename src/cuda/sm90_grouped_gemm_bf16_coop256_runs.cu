// The sm90 grouped GEMM with bf16 inputs on the cooperative schedule, 256x128 tiles on 2x1
// clusters, dealt to the clusters in runs (RaggedDotImpl::kCudaSm90Cooperative256Runs; see
// sm90_grouped_gemm.cu and sm90_run_scheduler.cuh).
#include "cuda/sm90_grouped_gemm.cuh"

namespace moekit::detail::cuda::tc {
MOEKIT_TC_INSTANTIATE(sm90::KernelCoop256Runs, cutlass::bfloat16_t)
}  // namespace moekit::detail::cuda::tc
