// ragged_dot on NVIDIA GPUs: the three calls of ragged_dot.h (SPEC.md section 1) with every
// buffer in device memory, the group sizes and group offset included, so that a call never
// synchronises with the host and launches the same kernels every time (it can be captured in a
// CUDA graph).
//
// What the host can check is checked before anything is launched, with the errors of
// ragged_dot.h: ranks, shapes, dtypes, strides, null pointers, G >= E_loc, a host group_offset
// in range. What lives on the device is clamped there instead of checked: a negative group size
// counts as 0, group_offset is clamped into [0, G - E_loc], and rows past m are dropped from
// their group, so that no kernel reads or writes out of bounds whatever the sizes hold.
//
// Dtypes: lhs and rhs both bf16, both f16 (tensor cores, CUTLASS grouped GEMM on sm90 and sm80)
// or both f32 (a portable kernel, slower); out f32 or the input dtype; f32 accumulation always.
// The tensor-core path also needs 16-byte aligned base pointers and row strides (a multiple of
// 8 elements) and K, n multiples of 8; other calls take the portable kernel.
//
// Built without the CUDA backend (MOEKIT_CUDA=OFF, or AUTO where nvcc or CUTLASS is missing),
// every function here returns kUnimplemented.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moekit/ragged_dot.h"
#include "moekit/status.h"
#include "moekit/view.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace moekit {

// The groups, in device memory.
struct CudaGroups {
  const int32_t* sizes = nullptr;   // [G] int32, device
  int64_t count = 0;                // G
  const int32_t* offset = nullptr;  // [1] int32, device; null: RaggedDotOptions::group_offset
};

// Where and with what scratch a call runs. The workspace is device memory of at least
// ragged_dot_cuda_workspace_size(E_loc) bytes, 256-byte aligned, owned by the caller; calls on
// one stream may share it.
struct CudaExec {
  CUstream_st* stream = nullptr;  // null: the legacy default stream
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Which implementation runs on the GPU. kAuto: CUTLASS grouped GEMM on tensor cores where the
// device and the call allow it (sm90a kernels on compute capability 9.0, sm80 kernels on 8.x
// and later), otherwise the portable kernel.
enum class RaggedDotCudaImpl { kAuto, kSm90, kSm80, kPortable };

// Bytes of workspace any call with E_loc = num_local_groups needs on the current device.
size_t ragged_dot_cuda_workspace_size(int64_t num_local_groups);

// Forward. Shapes and dtypes as ragged_dot() in ragged_dot.h, every tensor in device memory.
//   lhs [m, K], rhs [E_loc, K, n] ([E_loc, n, K] if options.rhs_transposed), out [m, n]
Status ragged_dot_cuda(ConstTensorView lhs, ConstTensorView rhs, const CudaGroups& groups,
                       TensorView out, const RaggedDotOptions& options, const CudaExec& exec,
                       RaggedDotCudaImpl impl = RaggedDotCudaImpl::kAuto);

// Input gradient: d_out [m, n], rhs as in the forward, d_lhs [m, K].
Status ragged_dot_dlhs_cuda(ConstTensorView d_out, ConstTensorView rhs, const CudaGroups& groups,
                            TensorView d_lhs, const RaggedDotOptions& options, const CudaExec& exec,
                            RaggedDotCudaImpl impl = RaggedDotCudaImpl::kAuto);

// Weight gradient: lhs [m, K], d_out [m, n], d_rhs [E_loc, K, n] ([E_loc, n, K] transposed);
// exactly 0 for an empty group (untouched with accumulate).
Status ragged_dot_drhs_cuda(ConstTensorView lhs, ConstTensorView d_out, const CudaGroups& groups,
                            TensorView d_rhs, const RaggedDotOptions& options, const CudaExec& exec,
                            RaggedDotCudaImpl impl = RaggedDotCudaImpl::kAuto);

// Whether this build has the CUDA backend and how many devices it sees (0 when
// none, or when built without CUDA). Never fails.
bool cuda_built();
int cuda_device_count();

}  // namespace moekit
