// Internal: the two shapes of grouped GEMM that ragged_dot and its gradients reduce to, after
// validation. Backends implement these two; the public functions in src/ragged_dot.cpp only
// validate, build one of them and dispatch.
#pragma once

#include <cstdint>
#include <span>

#include "cpu/convert.h"
#include "moekit/dtype.h"
#include "moekit/status.h"

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

// Scalar references (src/cpu/ragged_dot_ref.cpp): plain loops, f32 accumulation, no threads.
Status row_grouped_gemm_ref(const RowGroupedGemm& g);
Status contraction_grouped_gemm_ref(const ContractionGroupedGemm& g);

// oneDNN (src/cpu/ragged_dot_onednn.cpp): one cached runtime-dimension matmul per group.
Status row_grouped_gemm_onednn(const RowGroupedGemm& g);
Status contraction_grouped_gemm_onednn(const ContractionGroupedGemm& g);

// Sets rows [begin, end) of a [rows, n] matrix with row stride ld to zero.
void zero_rows(void* base, DType t, int64_t ld, int64_t n, int64_t begin, int64_t end);

}  // namespace moekit::detail
