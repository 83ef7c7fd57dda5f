// Where an op runs, and with what: the execution context every op of moekit takes last (ragged_dot,
// the router, the permutation, the activation, the layer), so that one call runs on the CPU or on
// a GPU. A view carries no device: the caller says where its buffers live.
//
// On the CPU every buffer is host memory and stream and workspace are ignored. On CUDA every
// tensor, every index or count array and every scalar result (a loss) is device memory of the
// current device; the call is queued on `stream` and returns without waiting for the GPU (no host
// synchronisation: a pass can be captured in a CUDA graph). What the host cannot see (values in
// device memory) the kernels clamp instead of checking, and never read or write out of bounds;
// each op's header says how.
#pragma once

#include <cstddef>

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace moekit {

// Where a call's buffers live, and so which backend runs it.
enum class Device { kCpu, kCuda };

// The device, the stream and the caller's scratch. An op that needs scratch on CUDA says so in
// its header with a function that sizes it (ragged_dot_workspace_size, router_workspace_size,
// permute_workspace_size): device memory of at least that many bytes, 256-byte aligned, owned by
// the caller; calls queued one after another on one stream may share it.
struct Exec {
  Device device = Device::kCpu;
  CUstream_st* stream = nullptr;  // CUDA; null: the legacy default stream
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Whether this build has the CUDA backend (MOEKIT_CUDA=ON, or AUTO where nvcc and CUTLASS were
// found; without it a CUDA call returns kUnimplemented), and how many devices it sees (0 when
// none, or when built without CUDA). Never fail.
bool cuda_built();
int cuda_device_count();

}  // namespace moekit
