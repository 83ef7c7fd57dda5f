// Internal: the two shapes of grouped GEMM that ragged_dot and its gradients reduce to, and the
// checks every ragged_dot call makes on its shapes, dtypes and strides before it builds one.
// Shared by the CPU entry points (ragged_dot.cpp, backends in cpu/grouped_gemm.h) and the CUDA
// ones (ragged_dot_cuda.cpp, backends in cuda/grouped_gemm_cuda.h). The builders fill everything
// but the groups, which the caller checks (host sizes) or hands to the device (device sizes).
#pragma once

#include <cstdint>
#include <span>

#include "moekit/dtype.h"
#include "moekit/ragged_dot.h"
#include "moekit/status.h"
#include "moekit/view.h"

namespace moekit::detail {

// The rows of each group span [begin, end) of the row dimension. Row ranges for all groups, local
// or not, follow from group_sizes; only the local ones are ever touched.
struct GroupRows {
  std::span<const int32_t> sizes;  // [G]
  int32_t offset = 0;              // first local group
  int64_t num_local = 0;           // E_loc
  // Row range of the local groups taken together.
  int64_t local_begin = 0, local_end = 0;
};

// Row-grouped: for each local group j, C[rows of j] (+)= A[rows of j] @ B_{j - offset}.
// Forward and input gradient.
//   A  [m, kc]   a + r*lda
//   B  [E_loc] x [kc, n], element (j, k, c) at b + j*b_batch + k*b_s0 + c*b_s1
//   C  [m, n]    c + r*ldc; non-local rows set to 0 unless accumulate
struct RowGroupedGemm {
  DType in_type, out_type;
  int64_t m, kc, n;
  const void* a;
  int64_t lda;
  const void* b;
  int64_t b_batch, b_s0, b_s1;
  void* c;
  int64_t ldc;
  GroupRows groups;
  bool accumulate;
};

// Contraction-grouped: for each local group j, C_{j - offset} (+)= X[rows of j]^T @ Y[rows of j].
// Weight gradient.
//   X  [m, p]   x + r*ldx
//   Y  [m, q]   y + r*ldy
//   C  [E_loc] x [p, q], element (j, i, c) at c + j*c_batch + i*ldc + c; empty groups 0 unless
//      accumulate
struct ContractionGroupedGemm {
  DType in_type, out_type;
  int64_t m, p, q;
  const void* x;
  int64_t ldx;
  const void* y;
  int64_t ldy;
  void* c;
  int64_t c_batch, ldc;
  GroupRows groups;
  bool accumulate;
};

// The forward (contract_over_rhs_n = false: a = lhs [m, K], c = out [m, n]) and the input
// gradient (true: a = d_out [m, n], c = d_lhs [m, K]), against rhs [E_loc, K, n] ([E_loc, n, K]
// when options.rhs_transposed). allow_f16: f16 inputs are accepted besides f32 and bf16.
Status row_problem(const char* op, const char* a_name, ConstTensorView a, ConstTensorView rhs,
                   const char* c_name, TensorView c, const RaggedDotOptions& options,
                   bool contract_over_rhs_n, bool allow_f16, RowGroupedGemm* out);

// G = `count` groups (named by count_name) hold the E_loc local ones: G >= E_loc.
Status check_group_count(const char* op, const char* count_name, int64_t count, int64_t num_local);
// A group_offset known on the host is in [0, G - E_loc].
Status check_group_offset(const char* op, int64_t offset, int64_t count, int64_t num_local);

// The weight gradient: lhs [m, K], d_out [m, n] into d_rhs [E_loc, K, n] ([E_loc, n, K]).
Status contraction_problem(const char* op, ConstTensorView lhs, ConstTensorView d_out,
                           TensorView d_rhs, const RaggedDotOptions& options, bool allow_f16,
                           ContractionGroupedGemm* out);

}  // namespace moekit::detail
