// The XLA FFI handlers of ragged_dot for JAX's CUDA platform, registered under the CPU handlers'
// names (moekit/jax/_ffi.py), so that one jax.ffi.ffi_call runs on whichever device holds the
// arrays. Every buffer is in device memory, group_sizes and group_offset included: a call reads
// neither on the host and runs on the stream XLA gives it, so nothing here waits for the GPU.
//
// The workspace is a second result, which XLA allocates with the call's other buffers and
// moekit/jax/ragged_dot.py drops (sized at trace time: moekit_ffi_cuda_workspace_bytes). A call
// therefore allocates nothing, and launches the same kernels with the same arguments for the same
// buffers: XLA may trace it into a CUDA graph (kCmdBufferCompatible). Memory from the FFI scratch
// allocator would not do: it is freed when the handler returns, while the graph would keep
// using it on every replay.
#include <cstddef>
#include <cstdint>
#include <span>

#include "ffi_common.h"
#include "moekit/ragged_dot.h"

namespace moekit::python {
namespace {

using Stream = CUstream_st*;  // cudaStream_t

// On the device, on XLA's stream, with the workspace result from its first
// kCudaWorkspaceAlign-aligned byte on. The call checks that what is left is enough.
RaggedDotExec exec_on(Stream stream, ffi::AnyBuffer workspace) {
  const auto base = reinterpret_cast<uintptr_t>(workspace.untyped_data());
  const uintptr_t aligned =
      (base + kCudaWorkspaceAlign - 1) / kCudaWorkspaceAlign * kCudaWorkspaceAlign;
  const size_t skipped = aligned - base;
  return RaggedDotExec{
      .device = Device::kCuda,
      .stream = stream,
      .workspace = reinterpret_cast<void*>(aligned),
      .workspace_bytes = workspace.size_bytes() > skipped ? workspace.size_bytes() - skipped : 0};
}

// out [m, n] = ragged_dot(lhs [m, K], rhs [E_loc, K, n]) over the local groups.
ffi::Error ragged_dot_fwd(Stream stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                          ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::S32> offset,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                          bool batch_invariant) {
  return call_ragged(ragged_dot, {"lhs", "rhs", "out"}, lhs, rhs, sizes, offset, *out,
                     batch_invariant, exec_on(stream, *workspace));
}

// d_lhs [m, K] = ragged_dot(d_out [m, n], rhs^T).
ffi::Error ragged_dot_dlhs(Stream stream, ffi::AnyBuffer d_out, ffi::AnyBuffer rhs,
                           ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::S32> offset,
                           ffi::Result<ffi::AnyBuffer> d_lhs, ffi::Result<ffi::AnyBuffer> workspace,
                           bool batch_invariant) {
  return call_ragged(moekit::ragged_dot_dlhs, {"d_out", "rhs", "d_lhs"}, d_out, rhs, sizes, offset,
                     *d_lhs, batch_invariant, exec_on(stream, *workspace));
}

// d_rhs [E_loc, K, n]: lhs[rows of j]^T @ d_out[rows of j] per local group, 0 for empty ones.
ffi::Error ragged_dot_drhs(Stream stream, ffi::AnyBuffer lhs, ffi::AnyBuffer d_out,
                           ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::S32> offset,
                           ffi::Result<ffi::AnyBuffer> d_rhs, ffi::Result<ffi::AnyBuffer> workspace,
                           bool batch_invariant) {
  return call_ragged(moekit::ragged_dot_drhs, {"lhs", "d_out", "d_rhs"}, lhs, d_out, sizes, offset,
                     *d_rhs, batch_invariant, exec_on(stream, *workspace));
}

// The stream, the CPU handlers' arguments and result, then the workspace.
auto cuda_binding() {
  return ragged_binding(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<Stream>>())
      .Ret<ffi::AnyBuffer>()
      .Attr<bool>("batch_invariant");
}

XLA_FFI_DEFINE_HANDLER(kRaggedDotFwd, ragged_dot_fwd, cuda_binding(),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kRaggedDotDlhs, ragged_dot_dlhs, cuda_binding(),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kRaggedDotDrhs, ragged_dot_drhs, cuda_binding(),
                       {ffi::Traits::kCmdBufferCompatible});

constexpr Target kTargets[] = {
    {"moekit_ragged_dot_fwd", "CUDA", kRaggedDotFwd},
    {"moekit_ragged_dot_dlhs", "CUDA", kRaggedDotDlhs},
    {"moekit_ragged_dot_drhs", "CUDA", kRaggedDotDrhs},
};

}  // namespace

std::span<const Target> cuda_targets() { return kTargets; }

}  // namespace moekit::python
