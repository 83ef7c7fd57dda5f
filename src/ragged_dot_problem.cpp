#include "ragged_dot_problem.h"

#include <fmt/format.h>

#include "check.h"

namespace moekit::detail {
namespace {

Status check_float_input(const char* op, const char* name, DType t, bool allow_f16) {
  if (allow_f16 && t == DType::kF16) return {};
  return check_input_dtype(op, name, t);
}

}  // namespace

Status row_problem(const char* op, const char* a_name, ConstTensorView a, ConstTensorView rhs,
                   const char* c_name, TensorView c, const RaggedDotOptions& opt,
                   bool contract_over_rhs_n, bool allow_f16, RowGroupedGemm* out) {
  MOEKIT_RETURN_IF_ERROR(check_view(op, a_name, a, 2));
  MOEKIT_RETURN_IF_ERROR(check_view(op, "rhs", rhs, 3));
  MOEKIT_RETURN_IF_ERROR(check_view(op, c_name, c, 2));
  MOEKIT_RETURN_IF_ERROR(check_float_input(op, a_name, a.dtype, allow_f16));
  MOEKIT_RETURN_IF_ERROR(check_same_dtype(op, "rhs", rhs.dtype, a_name, a.dtype));
  MOEKIT_RETURN_IF_ERROR(check_output_dtype(op, c_name, c.dtype, a.dtype));

  // rhs[j] is [K, n] (or [n, K] transposed). Its dims and strides, named by role:
  const int k_dim = opt.rhs_transposed ? 2 : 1, n_dim = opt.rhs_transposed ? 1 : 2;
  const int in_dim = contract_over_rhs_n ? n_dim : k_dim;   // contracted with a's columns
  const int out_dim = contract_over_rhs_n ? k_dim : n_dim;  // becomes c's columns
  const int64_t m = a.shape[0];
  MOEKIT_RETURN_IF_ERROR(
      check_dim(op, "rhs", rhs, in_dim, a.shape[1], fmt::format("{}.shape[1]", a_name).c_str()));
  MOEKIT_RETURN_IF_ERROR(
      check_dim(op, c_name, c, 0, m, fmt::format("{}.shape[0]", a_name).c_str()));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, c_name, c, 1, rhs.shape[out_dim],
                                   fmt::format("rhs.shape[{}]", out_dim).c_str()));
  *out = RowGroupedGemm{a.dtype,
                        c.dtype,
                        m,
                        a.shape[1],
                        c.shape[1],
                        a.data,
                        a.stride[0],
                        rhs.data,
                        rhs.stride[0],
                        rhs.stride[in_dim],
                        rhs.stride[out_dim],
                        c.data,
                        c.stride[0],
                        GroupRows{},
                        opt.accumulate};
  return {};
}

Status check_group_count(const char* op, const char* count_name, int64_t count, int64_t num_local) {
  if (count >= num_local) return {};
  return Status::invalid_argument(
      op, count_name, std::to_string(count),
      fmt::format("must be >= E_loc = {} (groups held locally)", num_local));
}

Status check_group_offset(const char* op, int64_t offset, int64_t count, int64_t num_local) {
  if (offset >= 0 && offset <= count - num_local) return {};
  return Status::invalid_argument(
      op, "group_offset", std::to_string(offset),
      fmt::format("must be in [0, G - E_loc] = [0, {}]", count - num_local));
}

Status contraction_problem(const char* op, ConstTensorView lhs, ConstTensorView d_out,
                           TensorView d_rhs, const RaggedDotOptions& options, bool allow_f16,
                           ContractionGroupedGemm* out) {
  MOEKIT_RETURN_IF_ERROR(check_view(op, "lhs", lhs, 2));
  MOEKIT_RETURN_IF_ERROR(check_view(op, "d_out", d_out, 2));
  MOEKIT_RETURN_IF_ERROR(check_view(op, "d_rhs", d_rhs, 3));
  MOEKIT_RETURN_IF_ERROR(check_float_input(op, "lhs", lhs.dtype, allow_f16));
  MOEKIT_RETURN_IF_ERROR(check_same_dtype(op, "d_out", d_out.dtype, "lhs", lhs.dtype));
  MOEKIT_RETURN_IF_ERROR(check_output_dtype(op, "d_rhs", d_rhs.dtype, lhs.dtype));
  const int64_t m = lhs.shape[0];
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "d_out", d_out, 0, m, "lhs.shape[0]"));
  const int k_dim = options.rhs_transposed ? 2 : 1, n_dim = options.rhs_transposed ? 1 : 2;
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "d_rhs", d_rhs, k_dim, lhs.shape[1], "lhs.shape[1]"));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "d_rhs", d_rhs, n_dim, d_out.shape[1], "d_out.shape[1]"));

  // d_rhs[j] is X^T Y over the group's rows, with X the operand that indexes d_rhs's rows.
  const ConstTensorView& x = options.rhs_transposed ? d_out : lhs;
  const ConstTensorView& y = options.rhs_transposed ? lhs : d_out;
  *out = ContractionGroupedGemm{
      lhs.dtype,       d_rhs.dtype,     m,           x.shape[1],        y.shape[1],
      x.data,          x.stride[0],     y.data,      y.stride[0],       d_rhs.data,
      d_rhs.stride[0], d_rhs.stride[1], GroupRows{}, options.accumulate};
  return {};
}

}  // namespace moekit::detail
