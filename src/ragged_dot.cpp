// Public ragged_dot entry points: validate every argument (nothing is written before this is
// done), reduce the call to one of the two grouped-GEMM problems of cpu/grouped_gemm.h, and
// dispatch it to the first implementation that the options allow (the reference last).
#include "moekit/ragged_dot.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string>
#include <vector>

#include "check.h"
#include "cpu/grouped_gemm.h"

namespace moekit {
namespace {

using detail::check_dim;
using detail::check_input_dtype;
using detail::check_output_dtype;
using detail::check_same_dtype;
using detail::check_view;
using detail::ContractionGroupedGemm;
using detail::GroupRows;
using detail::RowGroupedGemm;

// group_sizes, group_offset and E_loc against m; fills the local row range.
Status check_groups(const char* op, std::span<const int32_t> sizes, int32_t offset,
                    int64_t num_local, int64_t m, GroupRows* out) {
  const int64_t G = static_cast<int64_t>(sizes.size());
  if (G < num_local) {
    return Status::invalid_argument(
        op, "group_sizes.size()", std::to_string(G),
        fmt::format("must be >= E_loc = {} (groups held locally)", num_local));
  }
  if (G > 0 && sizes.data() == nullptr) {
    return Status::invalid_argument(op, "group_sizes.data", "null", "non-empty span needs data");
  }
  if (offset < 0 || offset > G - num_local) {
    return Status::invalid_argument(
        op, "group_offset", std::to_string(offset),
        fmt::format("must be in [0, G - E_loc] = [0, {}]", G - num_local));
  }
  int64_t total = 0, begin = 0, end = 0;
  for (int64_t j = 0; j < G; ++j) {
    if (sizes[j] < 0) {
      return Status::invalid_argument(op, fmt::format("group_sizes[{}]", j),
                                      std::to_string(sizes[j]), "group sizes must be >= 0");
    }
    if (j == offset) begin = total;
    total += sizes[j];
    if (j == offset + num_local - 1) end = total;
  }
  if (num_local == 0 || G == 0) begin = end = 0;
  if (total > m) {
    return Status::invalid_argument(op, "sum(group_sizes)", std::to_string(total),
                                    fmt::format("exceeds the {} rows of the input", m));
  }
  *out = GroupRows{sizes, offset, num_local, begin, end};
  return {};
}

template <typename Problem>
struct Implementation {
  RaggedDotImpl id;
  const char* name;
  Status (*run)(const Problem&);
};

// Ordered fastest first, the reference last.
constexpr Implementation<RowGroupedGemm> kRowImpls[] = {
    {RaggedDotImpl::kOneDnn, "onednn", detail::row_grouped_gemm_onednn},
    {RaggedDotImpl::kReference, "reference", detail::row_grouped_gemm_ref},
};
constexpr Implementation<ContractionGroupedGemm> kContractionImpls[] = {
    {RaggedDotImpl::kOneDnn, "onednn", detail::contraction_grouped_gemm_onednn},
    {RaggedDotImpl::kReference, "reference", detail::contraction_grouped_gemm_ref},
};

template <typename Problem, size_t N>
Status dispatch(const char* op, const Implementation<Problem> (&table)[N], RaggedDotImpl want,
                const Problem& problem) {
  for (const auto& impl : table) {
    if (want == RaggedDotImpl::kAuto || want == impl.id) return impl.run(problem);
  }
  return Status::unimplemented(
      op, fmt::format("no implementation {} for this call", static_cast<int>(want)));
}

// Shapes common to the forward and the input gradient: a [m, kc] input times the per-group
// matrices of rhs into a [m, n_out] output.
Status row_grouped(const char* op, const char* a_name, ConstTensorView a, ConstTensorView rhs,
                   std::span<const int32_t> sizes, const char* c_name, TensorView c,
                   const RaggedDotOptions& opt, bool contract_over_rhs_n) {
  MOEKIT_RETURN_IF_ERROR(check_view(op, a_name, a, 2));
  MOEKIT_RETURN_IF_ERROR(check_view(op, "rhs", rhs, 3));
  MOEKIT_RETURN_IF_ERROR(check_view(op, c_name, c, 2));
  MOEKIT_RETURN_IF_ERROR(check_input_dtype(op, a_name, a.dtype));
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
  GroupRows groups;
  MOEKIT_RETURN_IF_ERROR(check_groups(op, sizes, opt.group_offset, rhs.shape[0], m, &groups));

  RowGroupedGemm g{a.dtype,
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
                   groups,
                   opt.accumulate};
  return dispatch(op, kRowImpls, opt.impl, g);
}

}  // namespace

Status ragged_dot(ConstTensorView lhs, ConstTensorView rhs, std::span<const int32_t> group_sizes,
                  TensorView out, const RaggedDotOptions& options) {
  return row_grouped("ragged_dot", "lhs", lhs, rhs, group_sizes, "out", out, options,
                     /*contract_over_rhs_n=*/false);
}

Status ragged_dot_dlhs(ConstTensorView d_out, ConstTensorView rhs,
                       std::span<const int32_t> group_sizes, TensorView d_lhs,
                       const RaggedDotOptions& options) {
  return row_grouped("ragged_dot_dlhs", "d_out", d_out, rhs, group_sizes, "d_lhs", d_lhs, options,
                     /*contract_over_rhs_n=*/true);
}

Status ragged_dot_drhs(ConstTensorView lhs, ConstTensorView d_out,
                       std::span<const int32_t> group_sizes, TensorView d_rhs,
                       const RaggedDotOptions& options) {
  const char* op = "ragged_dot_drhs";
  MOEKIT_RETURN_IF_ERROR(check_view(op, "lhs", lhs, 2));
  MOEKIT_RETURN_IF_ERROR(check_view(op, "d_out", d_out, 2));
  MOEKIT_RETURN_IF_ERROR(check_view(op, "d_rhs", d_rhs, 3));
  MOEKIT_RETURN_IF_ERROR(check_input_dtype(op, "lhs", lhs.dtype));
  MOEKIT_RETURN_IF_ERROR(check_same_dtype(op, "d_out", d_out.dtype, "lhs", lhs.dtype));
  MOEKIT_RETURN_IF_ERROR(check_output_dtype(op, "d_rhs", d_rhs.dtype, lhs.dtype));
  const int64_t m = lhs.shape[0];
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "d_out", d_out, 0, m, "lhs.shape[0]"));
  const int k_dim = options.rhs_transposed ? 2 : 1, n_dim = options.rhs_transposed ? 1 : 2;
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "d_rhs", d_rhs, k_dim, lhs.shape[1], "lhs.shape[1]"));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "d_rhs", d_rhs, n_dim, d_out.shape[1], "d_out.shape[1]"));
  GroupRows groups;
  MOEKIT_RETURN_IF_ERROR(
      check_groups(op, group_sizes, options.group_offset, d_rhs.shape[0], m, &groups));

  // d_rhs[j] is X^T Y over the group's rows, with X the operand that indexes d_rhs's rows.
  const ConstTensorView& x = options.rhs_transposed ? d_out : lhs;
  const ConstTensorView& y = options.rhs_transposed ? lhs : d_out;
  ContractionGroupedGemm g{lhs.dtype,       d_rhs.dtype,     m,      x.shape[1],        y.shape[1],
                           x.data,          x.stride[0],     y.data, y.stride[0],       d_rhs.data,
                           d_rhs.stride[0], d_rhs.stride[1], groups, options.accumulate};
  return dispatch(op, kContractionImpls, options.impl, g);
}

int64_t ragged_dot_flops(std::span<const int32_t> group_sizes, int32_t group_offset,
                         int64_t num_local_groups, int64_t K, int64_t n) {
  int64_t rows = 0;
  for (int64_t j = group_offset;
       j < group_offset + num_local_groups && j < static_cast<int64_t>(group_sizes.size()); ++j) {
    rows += group_sizes[j];
  }
  return 2 * rows * K * n;
}

}  // namespace moekit
