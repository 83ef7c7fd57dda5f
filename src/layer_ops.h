// Internal: the steps the MoE layer (layer.cpp) takes besides the public ops, each on the CPU or
// a GPU by the Exec it is given, so that the layer is one code for both:
//   dense_dot*    the router's and the shared expert's matmuls: on the CPU ragged_dot with one
//                 group of every row (oneDNN), on CUDA cuBLAS (cuda/dense_dot_cublas.cpp);
//   add_rows      an f32 sum of two gradients; convert_rows: f32 rows rounded once into another
//                 dtype; copy_2d, zero_bytes: plain memory moves;
//   add_group_bias, group_sums  the expert biases: a per-group row added to the rows of the
//                 group, and its gradient, the sum of each group's rows;
//   synchronize   waits for the stream (the per-step timings of a profiled call only).
// Shapes are the layer's, checked there; a mismatch here is an internal error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "moekit/exec.h"
#include "moekit/ragged_dot.h"
#include "moekit/status.h"
#include "moekit/view.h"

namespace moekit::detail {

// c [m, n] (+)= a [m, K] @ b [K, n]: a, b f32 | bf16 (the same), c f32 | their dtype.
// options: accumulate and batch_invariant (the CPU's; refused on CUDA) as ragged_dot takes them.
Status dense_dot(ConstTensorView a, ConstTensorView b, TensorView c,
                 const RaggedDotOptions& options, const Exec& exec);
// d_a [m, K] (+)= d_c [m, n] @ b^T, b [K, n].
Status dense_dot_dlhs(ConstTensorView d_c, ConstTensorView b, TensorView d_a,
                      const RaggedDotOptions& options, const Exec& exec);
// d_b [K, n] (+)= a^T @ d_c, a [m, K], d_c [m, n].
Status dense_dot_drhs(ConstTensorView a, ConstTensorView d_c, TensorView d_b,
                      const RaggedDotOptions& options, const Exec& exec);
// Workspace bytes of the three calls (cuBLAS's on CUDA; none on the CPU).
size_t dense_dot_workspace_size(Device device);

// acc += v, both f32 [rows, cols] with unit inner stride.
Status add_rows(const TensorView& acc, const ConstTensorView& v, const Exec& exec);
// out [rows, cols] (any float dtype, strided) = in [rows, cols] f32, rounded once.
Status convert_rows(const ConstTensorView& in, const TensorView& out, const Exec& exec);
// rows [R, W] (x's dtype) += bias [G, W] (the same dtype) row g on the rows of group g, the rows
// grouped by sizes [G] (in exec's memory, as ragged_dot takes them): f32 sums, rounded once. Rows
// past the groups are left alone.
Status add_group_bias(const TensorView& rows, std::span<const int32_t> sizes,
                      const ConstTensorView& bias, const Exec& exec);
// out [G, W] (f32 or rows' dtype) = the sum of the rows of group g, in f32 (0 for an empty
// group), of rows [R, W] grouped by sizes as above.
Status group_sums(const ConstTensorView& rows, std::span<const int32_t> sizes,
                  const TensorView& out, const Exec& exec);
// `rows` rows of `row_bytes` bytes from src (pitch src_pitch) to dst (pitch dst_pitch).
Status copy_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
               size_t rows, const Exec& exec);
Status zero_bytes(void* dst, size_t bytes, const Exec& exec);
// Returns once the work queued on exec's stream has run (nothing to wait for on the CPU).
Status synchronize(const Exec& exec);

}  // namespace moekit::detail
