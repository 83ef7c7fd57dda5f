// Internal: the two shapes of grouped GEMM that ragged_dot and its gradients reduce to, and the
// checks every ragged_dot call makes on its shapes, dtypes and strides before it builds one.
// ragged_dot.cpp builds them and runs the first implementation of its table that takes them:
// the CPU's in cpu/grouped_gemm.h, the CUDA ones in cuda/grouped_gemm_cuda.h.
#pragma once

#include <cstdint>
#include <span>

#include "moekit/dtype.h"
#include "moekit/ragged_dot.h"
#include "moekit/status.h"
#include "moekit/view.h"

namespace moekit::detail {

// The groups, as the memory of the call holds them (Exec::device). Row ranges for all
// groups, local or not, follow from the sizes; only the local ones are ever touched.
struct Groups {
  const int32_t* sizes = nullptr;          // [count]: host memory (CPU) or device memory (CUDA)
  int64_t count = 0;                       // G
  int32_t offset = 0;                      // first local group, unless device_offset is set
  const int32_t* device_offset = nullptr;  // CUDA: [1] in device memory, read there
  int64_t num_local = 0;                   // E_loc
};

// Row-grouped: for each local group j, C[rows of j] (+)= A[rows of j] @ B_{j - offset}.
// Forward and input gradient.
//   A  [m, kc]   a + r*lda
//   B  [E_loc] x [kc, n], element (j, k, c) at b + j*b_batch + k*b_s0 + c*b_s1; or, where
//      b_packed (pack_ragged_rhs's layout, bf16 or f32: the forward's weights or the input
//      gradient's transpose), at b + j*b_batch + packed_b_offset(b_s0, k, c, in_type), b_s1 1
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
  Groups groups;
  bool accumulate;
  bool batch_invariant;  // RaggedDotOptions::batch_invariant
  Exec exec;
  bool b_packed = false;  // RaggedDotOptions::rhs_packed
};

// The packed layout's panels: output columns per panel. The contraction runs in steps of one
// 32-bit word a column: w = packed_word_elems elements (bf16 2, f32 1), so element (k, c) of a
// group's weights lies at, from its start (b_s0: its panels' stride),
//   (c / 32) b_s0 + 32 w (k / w) + w (c % 32) + k % w.
inline constexpr int64_t kPackedPanel = 32;
inline constexpr int64_t packed_word_elems(DType t) { return t == DType::kF32 ? 1 : 2; }
inline int64_t packed_b_offset(int64_t b_s0, int64_t k, int64_t c, DType t) {
  const int64_t w = packed_word_elems(t);
  return (c / kPackedPanel) * b_s0 + kPackedPanel * w * (k / w) + w * (c % kPackedPanel) + k % w;
}

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
  Groups groups;
  bool accumulate;
  bool batch_invariant;  // RaggedDotOptions::batch_invariant
  Exec exec;
};

// The forward (contract_over_rhs_n = false: a = lhs [m, K], c = out [m, n]) and the input
// gradient (true: a = d_out [m, n], c = d_lhs [m, K]), against rhs [E_loc, K, n] ([E_loc, n, K]
// when options.rhs_transposed). Everything but the groups, which check_groups fills.
Status row_problem(const char* op, const char* a_name, ConstTensorView a, ConstTensorView rhs,
                   const char* c_name, TensorView c, const RaggedDotOptions& options,
                   const Exec& exec, bool contract_over_rhs_n, RowGroupedGemm* out);

// The weight gradient: lhs [m, K], d_out [m, n] into d_rhs [E_loc, K, n] ([E_loc, n, K]).
Status contraction_problem(const char* op, ConstTensorView lhs, ConstTensorView d_out,
                           TensorView d_rhs, const RaggedDotOptions& options, const Exec& exec,
                           ContractionGroupedGemm* out);

// The groups against E_loc local ones and m rows: G >= E_loc, a host offset in [0, G - E_loc],
// and on the CPU each size >= 0 and their sum <= m (on CUDA the device clamps them).
Status check_groups(const char* op, const RaggedDotGroups& groups, const Exec& exec,
                    int64_t num_local, int64_t m, Groups* out);

}  // namespace moekit::detail
