// The layer's dense matmuls on CUDA (layer_ops.h): cublasGemmEx with f32 accumulation
// (CUBLAS_COMPUTE_32F: no TF32 for f32 inputs), one handle per host thread and device, kept for
// the life of the process; each call sets the stream and the caller's workspace on it, so that a
// call allocates nothing and can be captured in a CUDA graph.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <array>
#include <limits>
#include <string>

#include "cuda/layer_ops_cuda.h"

namespace moekit::detail::cuda {
namespace {

constexpr int kMaxDevices = 64;

// NVIDIA's recommended cuBLAS workspace for Hopper (4 MiB suffices before it).
constexpr size_t kCublasWorkspace = size_t{32} << 20;

Status cublas_error(const char* op, const char* what, cublasStatus_t s) {
  if (s == CUBLAS_STATUS_SUCCESS) return {};
  return Status::internal(op,
                          std::string("cuBLAS error in ") + what + ": " + cublasGetStatusString(s));
}

// This thread's handle for the current device (created on first use).
Status handle(const char* op, cublasHandle_t* out) {
  thread_local std::array<cublasHandle_t, kMaxDevices> handles{};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) {
    return Status::internal(op, "cudaGetDevice: no usable current device");
  }
  if (handles[device] == nullptr) {
    MOEKIT_RETURN_IF_ERROR(cublas_error(op, "cublasCreate", cublasCreate(&handles[device])));
  }
  *out = handles[device];
  return {};
}

cudaDataType_t cuda_type(DType t) { return t == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F; }

bool fits_int(int64_t v) { return v >= 0 && v <= std::numeric_limits<int>::max(); }

}  // namespace

size_t cublas_workspace_bytes() { return kCublasWorkspace; }

Status cublas_matmul(const char* op, ConstTensorView a, bool trans_a, ConstTensorView b,
                     bool trans_b, TensorView c, bool accumulate, const Exec& exec) {
  // Row-major C [m, n] = op(A) [m, K] @ op(B) [K, n] is column-major C^T = op(B)^T op(A)^T: a
  // row-major matrix is its transpose in column-major, so A and B swap and keep their flags.
  const int64_t m = c.shape[0], n = c.shape[1];
  const int64_t K = trans_a ? a.shape[0] : a.shape[1];
  if ((trans_a ? a.shape[1] : a.shape[0]) != m || (trans_b ? b.shape[1] : b.shape[0]) != K ||
      (trans_b ? b.shape[0] : b.shape[1]) != n || a.dtype != b.dtype) {
    return Status::internal(op, "dense matmul: operands that do not fit (the layer's shapes)");
  }
  if (!fits_int(m) || !fits_int(n) || !fits_int(K) || !fits_int(a.stride[0]) ||
      !fits_int(b.stride[0]) || !fits_int(c.stride[0])) {
    return Status::invalid_argument(
        op, "shapes", std::to_string(m) + " x " + std::to_string(K) + " x " + std::to_string(n),
        "past cuBLAS's int sizes");
  }
  if (m == 0 || n == 0) return {};
  const size_t elem = dtype_size(c.dtype);
  if (K == 0) {
    if (accumulate) return {};
    const cudaError_t e =
        cudaMemset2DAsync(c.data, static_cast<size_t>(c.stride[0]) * elem, 0,
                          static_cast<size_t>(n) * elem, static_cast<size_t>(m), exec.stream);
    if (e == cudaSuccess) return {};
    return Status::internal(
        op, std::string("CUDA error in cudaMemset2DAsync: ") + cudaGetErrorString(e));
  }
  cublasHandle_t h = nullptr;
  MOEKIT_RETURN_IF_ERROR(handle(op, &h));
  MOEKIT_RETURN_IF_ERROR(cublas_error(op, "cublasSetStream", cublasSetStream(h, exec.stream)));
  MOEKIT_RETURN_IF_ERROR(cublas_error(op, "cublasSetWorkspace",
                                      cublasSetWorkspace(h, exec.workspace, exec.workspace_bytes)));
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  return cublas_error(
      op, "cublasGemmEx",
      cublasGemmEx(h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                   static_cast<int>(n), static_cast<int>(m), static_cast<int>(K), &alpha, b.data,
                   cuda_type(b.dtype), static_cast<int>(b.stride[0]), a.data, cuda_type(a.dtype),
                   static_cast<int>(a.stride[0]), &beta, c.data, cuda_type(c.dtype),
                   static_cast<int>(c.stride[0]), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace moekit::detail::cuda
