// Test helper for the CUDA tests: device memory holding a copy of a HostTensor (the same bytes,
// padding included), viewed with the host tensor's shape and strides; and the macros that skip a
// test where there is no device and fail it on a CUDA error. Include only where MOEKIT_HAS_CUDA.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>

#include "host_tensor.h"
#include "moekit/exec.h"

namespace moekit {

// Skips the calling test unless a device is present.
#define MOEKIT_REQUIRE_GPU()                                                                 \
  do {                                                                                       \
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: the GPU test is skipped"; \
  } while (0)

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << cudaGetErrorString(cudaGetLastError())

// A failed CUDA call fails the test (and says which call).
inline void expect_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) ADD_FAILURE() << what << ": " << cudaGetErrorString(e);
}

// Device memory; a copy of a host tensor (same strides, padding included) or of plain values.
struct DeviceTensor {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceTensor(size_t n) : bytes(std::max<size_t>(n, 1)) {
    expect_cuda(cudaMalloc(&ptr, bytes), "cudaMalloc");
  }
  // A copy of h, uploaded.
  explicit DeviceTensor(const HostTensor& h) : DeviceTensor(h.bytes.size()) { upload(h); }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  ~DeviceTensor() { cudaFree(ptr); }
  // Returns once the copy has landed: cudaMemcpy from pageable memory may return before its DMA
  // ends, and work on a stream created cudaStreamNonBlocking does not wait for it (a graph replay
  // once read the output as it was before the upload, on an H200).
  void upload(const void* src, size_t n) {
    expect_cuda(cudaMemcpy(ptr, src, n, cudaMemcpyHostToDevice), "upload");
    expect_cuda(cudaDeviceSynchronize(), "upload");
  }
  void upload(const HostTensor& h) { upload(h.bytes.data(), h.bytes.size()); }
  void download(HostTensor& h) const {
    expect_cuda(cudaMemcpy(h.bytes.data(), ptr, h.bytes.size(), cudaMemcpyDeviceToHost),
                "download");
  }
  template <class View>
  View view_as(HostTensor& h) const {
    View v = h.view<View>();
    v.data = ptr;
    return v;
  }
  ConstTensorView in(HostTensor& h) const { return view_as<TensorView>(h); }
  TensorView mut(HostTensor& h) const { return view_as<TensorView>(h); }
};

// The execution context of a CUDA call on the default stream with `ws` as its workspace.
inline Exec cuda_exec(const DeviceTensor* ws = nullptr, cudaStream_t stream = nullptr) {
  return Exec{Device::kCuda, stream, ws ? ws->ptr : nullptr, ws ? ws->bytes : 0};
}

}  // namespace moekit
