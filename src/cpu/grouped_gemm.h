// Internal: the CPU implementations of the two grouped-GEMM problems of ragged_dot_problem.h.
#pragma once

#include <cstdint>

#include "cpu/convert.h"
#include "moekit/dtype.h"
#include "moekit/status.h"
#include "ragged_dot_problem.h"

namespace moekit::detail {

// Scalar references (src/cpu/ragged_dot_ref.cpp): plain loops, f32 accumulation, no threads.
Status row_grouped_gemm_ref(const RowGroupedGemm& g);
Status contraction_grouped_gemm_ref(const ContractionGroupedGemm& g);

// oneDNN (src/cpu/ragged_dot_onednn.cpp): one cached runtime-dimension matmul per group.
Status row_grouped_gemm_onednn(const RowGroupedGemm& g);
Status contraction_grouped_gemm_onednn(const ContractionGroupedGemm& g);

// Sets rows [begin, end) of a [rows, n] matrix with row stride ld to zero.
void zero_rows(void* base, DType t, int64_t ld, int64_t n, int64_t begin, int64_t end);

}  // namespace moekit::detail
