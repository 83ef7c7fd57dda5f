// Public ragged_dot entry points: validate every argument (nothing is written before this is
// done), reduce the call to one of the two grouped-GEMM problems of ragged_dot_problem.h, and
// run the first implementation that the options allow (the reference last).
#include "moekit/ragged_dot.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string>
#include <vector>

#include "check.h"
#include "cpu/grouped_gemm.h"
#include "ragged_dot_problem.h"

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
  MOEKIT_RETURN_IF_ERROR(detail::check_group_count(op, "group_sizes.size()", G, num_local));
  if (G > 0 && sizes.data() == nullptr) {
    return Status::invalid_argument(op, "group_sizes.data", "null", "non-empty span needs data");
  }
  MOEKIT_RETURN_IF_ERROR(detail::check_group_offset(op, offset, G, num_local));
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
Status run_implementation(const char* op, const Implementation<Problem> (&table)[N],
                          RaggedDotImpl want, const Problem& problem) {
  for (const auto& impl : table) {
    if (want == RaggedDotImpl::kAuto || want == impl.id) return impl.run(problem);
  }
  return Status::unimplemented(
      op, fmt::format("no implementation {} for this call", static_cast<int>(want)));
}

// The forward and the input gradient, once row_problem() has checked the shapes.
Status row_grouped(const char* op, const char* a_name, ConstTensorView a, ConstTensorView rhs,
                   std::span<const int32_t> sizes, const char* c_name, TensorView c,
                   const RaggedDotOptions& opt, bool contract_over_rhs_n) {
  RowGroupedGemm g;
  MOEKIT_RETURN_IF_ERROR(detail::row_problem(op, a_name, a, rhs, c_name, c, opt,
                                             contract_over_rhs_n, /*allow_f16=*/false, &g));
  MOEKIT_RETURN_IF_ERROR(check_groups(op, sizes, opt.group_offset, rhs.shape[0], g.m, &g.groups));
  MOEKIT_RETURN_IF_ERROR(detail::check_disjoint(
      op, {{c_name, c}}, {{a_name, a}, {"rhs", rhs}, {"group_sizes", sizes}}));
  return run_implementation(op, kRowImpls, opt.impl, g);
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
  ContractionGroupedGemm g;
  MOEKIT_RETURN_IF_ERROR(
      detail::contraction_problem(op, lhs, d_out, d_rhs, options, /*allow_f16=*/false, &g));
  MOEKIT_RETURN_IF_ERROR(
      check_groups(op, group_sizes, options.group_offset, d_rhs.shape[0], g.m, &g.groups));
  MOEKIT_RETURN_IF_ERROR(detail::check_disjoint(
      op, {{"d_rhs", d_rhs}}, {{"lhs", lhs}, {"d_out", d_out}, {"group_sizes", group_sizes}}));
  return run_implementation(op, kContractionImpls, options.impl, g);
}

int64_t ragged_dot_flops(std::span<const int32_t> group_sizes, int32_t group_offset,
                         int64_t num_local_groups, int64_t K, int64_t n) {
  if (group_offset < 0 || num_local_groups < 0 || K < 0 || n < 0) return -1;
  int64_t rows = 0, flops = 0;
  for (size_t j = static_cast<size_t>(group_offset);
       j < group_sizes.size() && static_cast<int64_t>(j) - group_offset < num_local_groups; ++j) {
    if (group_sizes[j] < 0 || __builtin_add_overflow(rows, group_sizes[j], &rows)) return -1;
  }
  if (!detail::mul_fits(rows, 2, &flops) || !detail::mul_fits(flops, K, &flops) ||
      !detail::mul_fits(flops, n, &flops)) {
    return -1;
  }
  return flops;
}

}  // namespace moekit
