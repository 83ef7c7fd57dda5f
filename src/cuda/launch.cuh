// Internal (nvcc only): what every CUDA implementation of moekit shares on the host side of a
// launch: CUDA errors as a Status, the caller's workspace checked and carved into arrays.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "moekit/exec.h"
#include "moekit/status.h"

namespace moekit::detail::cuda {

inline constexpr size_t kWorkspaceAlign = 256;

constexpr size_t align_up(size_t bytes, size_t a = kWorkspaceAlign) {
  return (bytes + a - 1) / a * a;
}

// "op: CUDA error in what: message" for the last launch or call, ok when there was none.
inline Status cuda_status(const char* op, const char* what, cudaError_t e) {
  if (e == cudaSuccess) return {};
  return Status::internal(op, std::string("CUDA error in ") + what + ": " + cudaGetErrorString(e));
}
inline Status launch_status(const char* op, const char* what) {
  return cuda_status(op, what, cudaGetLastError());
}

// The caller's workspace holds `need` bytes from a 256-byte aligned start; `sizer` names the
// function that sizes it, for the error.
inline Status check_workspace(const char* op, const Exec& exec, size_t need, const char* sizer) {
  if (exec.workspace_bytes < need || (need > 0 && exec.workspace == nullptr)) {
    return Status::invalid_argument(
        op, "exec.workspace_bytes", std::to_string(exec.workspace_bytes),
        std::string("smaller than ") + sizer + " = " + std::to_string(need));
  }
  if (reinterpret_cast<uintptr_t>(exec.workspace) % kWorkspaceAlign != 0) {
    return Status::invalid_argument(op, "exec.workspace", "misaligned",
                                    "must be 256-byte aligned (cudaMalloc gives that)");
  }
  return {};
}

// Hands out arrays of a workspace, 256-byte aligned one after the other. Addresses are computed
// as integers, so a null base gives the offsets and position() the bytes taken (for sizing).
class Carve {
 public:
  explicit Carve(void* base, size_t skip = 0) : at_(reinterpret_cast<uintptr_t>(base) + skip) {}
  template <class T>
  T* take(int64_t count) {
    const uintptr_t at = at_;
    at_ += align_up(sizeof(T) * static_cast<size_t>(count));
    return reinterpret_cast<T*>(at);
  }
  uintptr_t position() const { return at_; }

 private:
  uintptr_t at_;
};

}  // namespace moekit::detail::cuda
