#include "check.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace moekit::detail {

std::string shape_str(const ConstTensorView& v) {
  return fmt::format("[{}]", fmt::join(v.shape.begin(), v.shape.begin() + v.rank, ", "));
}

Status check_view(const char* op, const char* name, const ConstTensorView& v, int rank) {
  if (v.rank != rank) {
    return Status::invalid_argument(op, fmt::format("{}.rank", name), std::to_string(v.rank),
                                    fmt::format("expected a rank-{} tensor", rank));
  }
  for (int d = 0; d < rank; ++d) {
    if (v.shape[d] < 0) {
      return Status::invalid_argument(op, fmt::format("{}.shape", name), shape_str(v),
                                      "dimensions must be >= 0");
    }
  }
  if (v.numel() == 0) return {};
  if (v.data == nullptr) {
    return Status::invalid_argument(op, fmt::format("{}.data", name), "null",
                                    fmt::format("a tensor of shape {} needs data", shape_str(v)));
  }
  if (v.stride[rank - 1] != 1) {
    return Status::invalid_argument(op, fmt::format("{}.stride[{}]", name, rank - 1),
                                    std::to_string(v.stride[rank - 1]),
                                    "the innermost dimension must be contiguous (stride 1)");
  }
  for (int d = rank - 2; d >= 0; --d) {
    const int64_t inner_extent = v.shape[d + 1] * v.stride[d + 1];
    if (v.stride[d] < inner_extent) {
      return Status::invalid_argument(
          op, fmt::format("{}.stride[{}]", name, d), std::to_string(v.stride[d]),
          fmt::format("must be >= {} so that elements do not overlap", inner_extent));
    }
  }
  return {};
}

Status check_input_dtype(const char* op, const char* name, DType t) {
  if (t == DType::kF32 || t == DType::kBF16) return {};
  return Status::invalid_argument(op, fmt::format("{}.dtype", name), std::string(dtype_name(t)),
                                  "expected f32 or bf16");
}

Status check_same_dtype(const char* op, const char* name, DType t, const char* ref_name,
                        DType ref) {
  if (t == ref) return {};
  return Status::invalid_argument(
      op, fmt::format("{}.dtype", name), std::string(dtype_name(t)),
      fmt::format("must equal {}.dtype ({})", ref_name, dtype_name(ref)));
}

Status check_output_dtype(const char* op, const char* name, DType t, DType in) {
  if (t == DType::kF32 || t == in) return {};
  return Status::invalid_argument(
      op, fmt::format("{}.dtype", name), std::string(dtype_name(t)),
      fmt::format("expected f32 or the input dtype ({})", dtype_name(in)));
}

Status check_dim(const char* op, const char* name, const ConstTensorView& v, int dim,
                 int64_t expected, const char* expected_what) {
  if (v.shape[dim] == expected) return {};
  return Status::invalid_argument(
      op, fmt::format("{}.shape", name), shape_str(v),
      fmt::format("dimension {} must be {} = {}", dim, expected_what, expected));
}

Status check_dtype(const char* op, const char* name, DType t, DType want) {
  if (t == want) return {};
  return Status::invalid_argument(op, fmt::format("{}.dtype", name), std::string(dtype_name(t)),
                                  fmt::format("expected {}", dtype_name(want)));
}

Status check_matrix(const char* op, const char* name, const ConstTensorView& v, int64_t rows,
                    const char* rows_what, int64_t cols, const char* cols_what) {
  MOEKIT_RETURN_IF_ERROR(check_view(op, name, v, 2));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, name, v, 0, rows, rows_what));
  return check_dim(op, name, v, 1, cols, cols_what);
}

}  // namespace moekit::detail
