// Argument checks shared by every public entry point. Each returns an invalid-argument Status
// that names the op, the argument and its value, so that errors read the same across ops.
#pragma once

#include <cstdint>
#include <string>

#include "moekit/status.h"
#include "moekit/view.h"

namespace moekit::detail {

// *out = a * b, unless that overflows int64: then false (and *out is not to be used).
inline bool mul_fits(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}

// "[2, 3]"
std::string shape_str(const ConstTensorView& v);

// Rank, non-negative dims, a data pointer when non-empty, a unit innermost stride, and outer
// strides that keep distinct elements apart.
Status check_view(const char* op, const char* name, const ConstTensorView& v, int rank);

// An optional tensor is present unless default-constructed (rank 0, no data).
inline bool present(const ConstTensorView& v) { return v.rank != 0 || v.data != nullptr; }

// A rank-2 [rows, cols] tensor; the *_what strings name where the expected sizes come from.
Status check_matrix(const char* op, const char* name, const ConstTensorView& v, int64_t rows,
                    const char* rows_what, int64_t cols, const char* cols_what);

// f32 or bf16.
Status check_input_dtype(const char* op, const char* name, DType t);
// Exactly `want`.
Status check_dtype(const char* op, const char* name, DType t, DType want);
// Equal to the dtype of another argument.
Status check_same_dtype(const char* op, const char* name, DType t, const char* ref_name, DType ref);
// f32 or the input dtype.
Status check_output_dtype(const char* op, const char* name, DType t, DType in);
// v.shape[dim] == expected; `expected_what` names where the expected size comes from.
Status check_dim(const char* op, const char* name, const ConstTensorView& v, int dim,
                 int64_t expected, const char* expected_what);

}  // namespace moekit::detail
