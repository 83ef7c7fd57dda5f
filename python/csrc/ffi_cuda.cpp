// The XLA FFI handlers of ragged_dot for JAX's CUDA platform, registered under the CPU handlers'
// names (moekit/jax/_ffi.py), so that one jax.ffi.ffi_call runs on whichever device holds the
// arrays. Every buffer is in device memory, group_sizes and group_offset included: a call reads
// neither on the host, runs on the stream XLA gives it, and takes its workspace from XLA's scratch
// allocator, so nothing here waits for the GPU.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "ffi_common.h"
#include "moekit/ragged_dot_cuda.h"

namespace moekit::python {
namespace {

using Stream = CUstream_st*;  // cudaStream_t
using RaggedDotCudaCall = Status (*)(ConstTensorView, ConstTensorView, const CudaGroups&,
                                     TensorView, const RaggedDotOptions&, const CudaExec&,
                                     RaggedDotCudaImpl);

// The two float tensors a, b, the groups and the result of one call; `names` name them in the
// errors, and `weights` is the one of b and the result that holds the E_loc local matrices.
ffi::Error call_ragged(RaggedDotCudaCall fn, const char* const (&names)[3], bool weights_are_result,
                       Stream stream, ffi::ScratchAllocator& scratch, ffi::AnyBuffer a,
                       ffi::AnyBuffer b, ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::S32> offset,
                       ffi::AnyBuffer result) {
  ConstTensorView va, vb;
  TensorView out;
  MOEKIT_FFI_TRY(view_of(a, names[0], &va));
  MOEKIT_FFI_TRY(view_of(b, names[1], &vb));
  MOEKIT_FFI_TRY(view_of(result, names[2], &out));
  MOEKIT_FFI_TRY(check_group_buffers(sizes, offset));
  const CudaGroups groups{sizes.typed_data(), static_cast<int64_t>(sizes.element_count()),
                          offset.typed_data()};
  // The rank is the call's to check; until then E_loc is read only from a tensor that has one.
  const int64_t num_local =
      weights_are_result ? (out.rank > 0 ? out.shape[0] : 0) : (vb.rank > 0 ? vb.shape[0] : 0);
  CudaExec exec;
  exec.stream = stream;
  exec.workspace_bytes = ragged_dot_cuda_workspace_size(num_local);
  if (exec.workspace_bytes > 0) {
    const std::optional<void*> ws = scratch.Allocate(exec.workspace_bytes, 256);
    if (!ws.has_value()) {
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        "ragged_dot: no device scratch memory for the " +
                            std::to_string(exec.workspace_bytes) + "-byte workspace");
    }
    exec.workspace = *ws;
  }
  return to_error(fn(va, vb, groups, out, RaggedDotOptions(), exec, RaggedDotCudaImpl::kAuto));
}

// out [m, n] = ragged_dot(lhs [m, K], rhs [E_loc, K, n]) over the local groups.
ffi::Error ragged_dot_fwd(Stream stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer lhs,
                          ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> sizes,
                          ffi::Buffer<ffi::S32> offset, ffi::Result<ffi::AnyBuffer> out) {
  return call_ragged(ragged_dot_cuda, {"lhs", "rhs", "out"}, false, stream, scratch, lhs, rhs,
                     sizes, offset, *out);
}

// d_lhs [m, K] = ragged_dot(d_out [m, n], rhs^T).
ffi::Error ragged_dot_dlhs(Stream stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer d_out,
                           ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> sizes,
                           ffi::Buffer<ffi::S32> offset, ffi::Result<ffi::AnyBuffer> d_lhs) {
  return call_ragged(ragged_dot_dlhs_cuda, {"d_out", "rhs", "d_lhs"}, false, stream, scratch, d_out,
                     rhs, sizes, offset, *d_lhs);
}

// d_rhs [E_loc, K, n]: lhs[rows of j]^T @ d_out[rows of j] per local group, 0 for empty ones.
ffi::Error ragged_dot_drhs(Stream stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer lhs,
                           ffi::AnyBuffer d_out, ffi::Buffer<ffi::S32> sizes,
                           ffi::Buffer<ffi::S32> offset, ffi::Result<ffi::AnyBuffer> d_rhs) {
  return call_ragged(ragged_dot_drhs_cuda, {"lhs", "d_out", "d_rhs"}, true, stream, scratch, lhs,
                     d_out, sizes, offset, *d_rhs);
}

auto cuda_binding() {
  return ragged_binding(
      ffi::Ffi::Bind().Ctx<ffi::PlatformStream<Stream>>().Ctx<ffi::ScratchAllocator>());
}

XLA_FFI_DEFINE_HANDLER(kRaggedDotFwd, ragged_dot_fwd, cuda_binding());
XLA_FFI_DEFINE_HANDLER(kRaggedDotDlhs, ragged_dot_dlhs, cuda_binding());
XLA_FFI_DEFINE_HANDLER(kRaggedDotDrhs, ragged_dot_drhs, cuda_binding());

constexpr Target kTargets[] = {
    {"moekit_ragged_dot_fwd", "CUDA", kRaggedDotFwd},
    {"moekit_ragged_dot_dlhs", "CUDA", kRaggedDotDlhs},
    {"moekit_ragged_dot_drhs", "CUDA", kRaggedDotDrhs},
};

}  // namespace

std::span<const Target> cuda_targets() { return kTargets; }

}  // namespace moekit::python
