// The sm90 grouped GEMM with bf16 inputs on the pingpong schedule, 64x256 tiles, dealt to the
// multiprocessors in runs (RaggedDotImpl::kCudaSm90Pingpong64x256Runs; see sm90_grouped_gemm.cu
// and sm90_run_scheduler.cuh).
#include "cuda/sm90_grouped_gemm.cuh"

namespace moekit::detail::cuda::tc {
MOEKIT_TC_INSTANTIATE(sm90::KernelPingpong64Runs, cutlass::bfloat16_t)
}  // namespace moekit::detail::cuda::tc
