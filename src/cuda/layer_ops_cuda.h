// Internal: the CUDA side of layer_ops.h: cuBLAS matmuls (cuda/dense_dot_cublas.cpp) and the
// elementwise kernels and memory moves (cuda/layer_ops.cu). No CUDA header.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "moekit/exec.h"
#include "moekit/status.h"
#include "moekit/view.h"

namespace moekit::detail::cuda {

// C [m, n] (+)= op(A) @ op(B) in row-major terms, as layer_ops.h's three calls need it:
//   trans_a: A is stored [K, m] (a^T); trans_b: B is stored [n, K] (b^T).
Status cublas_matmul(const char* op, ConstTensorView a, bool trans_a, ConstTensorView b,
                     bool trans_b, TensorView c, bool accumulate, const Exec& exec);
size_t cublas_workspace_bytes();

Status add_rows_cuda(const TensorView& acc, const ConstTensorView& v, const Exec& exec);
Status convert_rows_cuda(const ConstTensorView& in, const TensorView& out, const Exec& exec);
// layer_ops.h's add_group_bias and group_sums, sizes in device memory.
Status add_group_bias_cuda(const TensorView& rows, std::span<const int32_t> sizes,
                           const ConstTensorView& bias, const Exec& exec);
Status group_sums_cuda(const ConstTensorView& rows, std::span<const int32_t> sizes,
                       const TensorView& out, const Exec& exec);
Status copy_2d_cuda(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                    size_t row_bytes, size_t rows, const Exec& exec);
Status zero_bytes_cuda(void* dst, size_t bytes, const Exec& exec);
Status synchronize_cuda(const Exec& exec);

}  // namespace moekit::detail::cuda
