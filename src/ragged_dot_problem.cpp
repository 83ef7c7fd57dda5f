#include "ragged_dot_problem.h"

#include <fmt/format.h>

#include "check.h"

namespace moekit::detail {
namespace {

// f32 and bf16 everywhere; f16 on CUDA only.
Status check_float_input(const char* op, const char* name, DType t, const Exec& exec) {
  if (exec.device == Device::kCuda && t == DType::kF16) return {};
  return check_input_dtype(op, name, t);
}

// The batch-invariant mode is the CPU's: the CUDA kernels have not been checked for it.
Status check_mode(const char* op, const RaggedDotOptions& opt, const Exec& exec) {
  if (opt.batch_invariant && exec.device == Device::kCuda) {
    return Status::unimplemented(op,
                                 "options.batch_invariant on CUDA buffers: the batch-invariant "
                                 "mode runs on the CPU only");
  }
  return {};
}

// The row problem of a [m, K], rhs and c [m, n] (checked), rhs's contraction stride b_s0 and
// output stride b_s1.
RowGroupedGemm row_gemm(const ConstTensorView& a, const ConstTensorView& rhs, const TensorView& c,
                        int64_t b_s0, int64_t b_s1, const RaggedDotOptions& opt, const Exec& exec) {
  return RowGroupedGemm{.in_type = a.dtype,
                        .out_type = c.dtype,
                        .m = a.shape[0],
                        .kc = a.shape[1],
                        .n = c.shape[1],
                        .a = a.data,
                        .lda = a.stride[0],
                        .b = rhs.data,
                        .b_batch = rhs.stride[0],
                        .b_s0 = b_s0,
                        .b_s1 = b_s1,
                        .c = c.data,
                        .ldc = c.stride[0],
                        .groups = {},
                        .accumulate = opt.accumulate,
                        .batch_invariant = opt.batch_invariant,
                        .exec = exec};
}

// A pass on packed weights (RaggedDotOptions::rhs_packed): a [m, kc], rhs packed for a
// contraction of kc into c's columns (packed_rhs_shape(E_loc, kc, c columns) for a's dtype, bf16
// or f32), c [m, n], on the CPU: the forward on the weights packed, the input gradient on their
// transpose packed. The common checks are row_problem's.
Status packed_row_problem(const char* op, const char* a_name, ConstTensorView a,
                          ConstTensorView rhs, const char* c_name, TensorView c,
                          const RaggedDotOptions& opt, const Exec& exec, RowGroupedGemm* out) {
  if (opt.rhs_transposed) {
    return Status::invalid_argument(op, "options.rhs_transposed", "true",
                                    "packed weights have one layout: rhs_transposed must be false "
                                    "with rhs_packed");
  }
  if (exec.device != Device::kCpu) {
    return Status::unimplemented(op,
                                 "options.rhs_packed on CUDA buffers: packed weights run on "
                                 "the CPU only");
  }
  if (a.dtype != DType::kBF16 && a.dtype != DType::kF32) {
    return Status::invalid_argument(
        op, fmt::format("{}.dtype", a_name), std::string(dtype_name(a.dtype)),
        "packed weights are bf16 or f32: a pass on them takes rows of one of those");
  }
  const PackedRhsShape want = packed_rhs_shape(rhs.shape[0], a.shape[1], c.shape[1], a.dtype);
  for (int d = 1; d < 3; ++d) {
    if (rhs.shape[d] != want.dims[d]) {
      return Status::invalid_argument(
          op, fmt::format("rhs.shape[{}]", d), std::to_string(rhs.shape[d]),
          fmt::format("weights packed for a contraction of {} ({}.shape[1]) into {} columns "
                      "({}.shape[1]) are [E_loc, {}, {}] (packed_rhs_shape)",
                      a.shape[1], a_name, c.shape[1], c_name, want.dims[1], want.dims[2]));
    }
  }
  MOEKIT_RETURN_IF_ERROR(
      check_dim(op, c_name, c, 0, a.shape[0], fmt::format("{}.shape[0]", a_name).c_str()));
  *out = row_gemm(a, rhs, c, rhs.stride[1], 1, opt, exec);
  out->b_packed = true;
  return {};
}

}  // namespace

Status row_problem(const char* op, const char* a_name, ConstTensorView a, ConstTensorView rhs,
                   const char* c_name, TensorView c, const RaggedDotOptions& opt, const Exec& exec,
                   bool contract_over_rhs_n, RowGroupedGemm* out) {
  MOEKIT_RETURN_IF_ERROR(check_view(op, a_name, a, 2));
  MOEKIT_RETURN_IF_ERROR(check_view(op, "rhs", rhs, 3));
  MOEKIT_RETURN_IF_ERROR(check_view(op, c_name, c, 2));
  MOEKIT_RETURN_IF_ERROR(check_float_input(op, a_name, a.dtype, exec));
  MOEKIT_RETURN_IF_ERROR(check_mode(op, opt, exec));
  MOEKIT_RETURN_IF_ERROR(check_same_dtype(op, "rhs", rhs.dtype, a_name, a.dtype));
  MOEKIT_RETURN_IF_ERROR(check_output_dtype(op, c_name, c.dtype, a.dtype));

  if (opt.rhs_packed) return packed_row_problem(op, a_name, a, rhs, c_name, c, opt, exec, out);
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
  *out = row_gemm(a, rhs, c, rhs.stride[in_dim], rhs.stride[out_dim], opt, exec);
  return {};
}

Status contraction_problem(const char* op, ConstTensorView lhs, ConstTensorView d_out,
                           TensorView d_rhs, const RaggedDotOptions& options, const Exec& exec,
                           ContractionGroupedGemm* out) {
  MOEKIT_RETURN_IF_ERROR(check_view(op, "lhs", lhs, 2));
  MOEKIT_RETURN_IF_ERROR(check_view(op, "d_out", d_out, 2));
  MOEKIT_RETURN_IF_ERROR(check_view(op, "d_rhs", d_rhs, 3));
  MOEKIT_RETURN_IF_ERROR(check_float_input(op, "lhs", lhs.dtype, exec));
  MOEKIT_RETURN_IF_ERROR(check_mode(op, options, exec));
  if (options.rhs_packed) {
    return Status::invalid_argument(op, "options.rhs_packed", "true",
                                    "the weight gradient writes the weights' own layout ([E_loc, "
                                    "K, n], or [E_loc, n, K] with rhs_transposed); pack it after");
  }
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
  *out = ContractionGroupedGemm{.in_type = lhs.dtype,
                                .out_type = d_rhs.dtype,
                                .m = m,
                                .p = x.shape[1],
                                .q = y.shape[1],
                                .x = x.data,
                                .ldx = x.stride[0],
                                .y = y.data,
                                .ldy = y.stride[0],
                                .c = d_rhs.data,
                                .c_batch = d_rhs.stride[0],
                                .ldc = d_rhs.stride[1],
                                .groups = {},
                                .accumulate = options.accumulate,
                                .batch_invariant = options.batch_invariant,
                                .exec = exec};
  return {};
}

Status check_groups(const char* op, const RaggedDotGroups& groups, const Exec& exec,
                    int64_t num_local, int64_t m, Groups* out) {
  const int64_t G = static_cast<int64_t>(groups.sizes.size());
  if (G < num_local) {
    return Status::invalid_argument(
        op, "group_sizes.size()", std::to_string(G),
        fmt::format("must be >= E_loc = {} (groups held locally)", num_local));
  }
  if (G > 0 && groups.sizes.data() == nullptr) {
    return Status::invalid_argument(op, "group_sizes.data", "null",
                                    fmt::format("{} groups need a size array", G));
  }
  if (groups.device_offset != nullptr && exec.device != Device::kCuda) {
    return Status::invalid_argument(op, "groups.device_offset", "set",
                                    "a device offset needs exec.device = kCuda");
  }
  const int32_t offset = groups.offset;
  if (groups.device_offset == nullptr && (offset < 0 || offset > G - num_local)) {
    return Status::invalid_argument(
        op, "group_offset", std::to_string(offset),
        fmt::format("must be in [0, G - E_loc] = [0, {}]", G - num_local));
  }
  *out = Groups{.sizes = groups.sizes.data(),
                .count = G,
                .offset = offset,
                .device_offset = groups.device_offset,
                .num_local = num_local};
  if (exec.device == Device::kCuda) return {};  // the sizes are on the device: clamped there

  int64_t total = 0;
  for (int64_t j = 0; j < G; ++j) {
    if (groups.sizes[j] < 0) {
      return Status::invalid_argument(op, fmt::format("group_sizes[{}]", j),
                                      std::to_string(groups.sizes[j]), "group sizes must be >= 0");
    }
    total += groups.sizes[j];
  }
  if (total > m) {
    return Status::invalid_argument(op, "sum(group_sizes)", std::to_string(total),
                                    fmt::format("exceeds the {} rows of the input", m));
  }
  return {};
}

}  // namespace moekit::detail
