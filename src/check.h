// Argument checks shared by every public entry point. Each returns an invalid-argument Status
// that names the op, the argument and its value, so that errors read the same across ops.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>

#include "moekit/exec.h"
#include "moekit/status.h"
#include "moekit/view.h"

namespace moekit::detail {

// *out = a * b, unless that overflows int64: then false (and *out is not to be used).
inline bool mul_fits(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}

// n rounded up to a multiple of a > 0 (n >= 0, the result known to fit).
inline int64_t round_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

// "[2, 3]"
std::string shape_str(const ConstTensorView& v);

// The execution context names a Device this build has: a bad device is an invalid argument, a
// CUDA one in a build without CUDA unimplemented.
Status check_exec(const char* op, const Exec& exec);

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

// The memory one argument of a call reads or writes, for check_disjoint: `rows` rows of
// `row_bytes` bytes, `row_stride` bytes apart, from byte `first`. Built from a view that passed
// check_view (its extent fits), or from a span; empty when it has no elements.
struct Region {
  const char* name;
  uintptr_t first = 0;
  uint64_t rows = 0, row_stride = 0, row_bytes = 0;

  Region(const char* name, const ConstTensorView& v);
  template <typename T>
  Region(const char* name, std::span<T> s)
      : Region(name, static_cast<const void*>(s.data()), s.size_bytes()) {}
  Region(const char* name, const void* data, size_t bytes);
  bool empty() const { return rows == 0 || row_bytes == 0; }
};

// Whether two regions share a byte. Exact for rows of one row stride (e.g. column blocks of one
// matrix) and for regions whose byte ranges are apart; otherwise they count as overlapping.
bool overlap(const Region& a, const Region& b);

// Every output disjoint from every input and from every other output (empty ones aside): a
// named error otherwise, before anything is written. No op here computes in place.
Status check_disjoint(const char* op, std::span<const Region> outputs,
                      std::span<const Region> inputs);
inline Status check_disjoint(const char* op, std::initializer_list<Region> outputs,
                             std::initializer_list<Region> inputs) {
  return check_disjoint(op, std::span(outputs.begin(), outputs.size()),
                        std::span(inputs.begin(), inputs.size()));
}

}  // namespace moekit::detail
