// Public permutation entry points: validate every argument and, for host buffers, every index
// (nothing is written before this is done), work out the block layout there, and run the first
// implementation of the op's table that takes the call: the CUDA kernels for CUDA buffers where
// moekit is built with them, the threaded CPU code, the scalar reference last.
#include "moekit/permute.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "check.h"
#include "cpu/permute_kernels.h"
#include "impl_table.h"
#if MOEKIT_HAS_CUDA
#include "cuda/permute_cuda.h"
#endif

namespace moekit {
namespace {

using detail::check_dim;
using detail::check_dtype;
using detail::check_input_dtype;
using detail::check_matrix;
using detail::check_output_dtype;
using detail::check_same_dtype;
using detail::check_view;
using detail::Implementation;
using detail::kCpuNeeds;
using detail::kCudaNeeds;
using detail::on_cpu;
using detail::on_cuda;
using detail::present;
using detail::round_up;
using detail::run_implementation;
#if MOEKIT_HAS_CUDA
namespace cu = detail::cuda;
// The first entry of every table where the build has CUDA.
#define MOEKIT_CUDA_ENTRY(fn) {PermuteImpl::kCuda, cu::fn, on_cuda, kCudaNeeds},
#else
#define MOEKIT_CUDA_ENTRY(fn)
#endif

constexpr Implementation<PermuteImpl, detail::PermuteProblem> kPermuteImpls[] = {
    MOEKIT_CUDA_ENTRY(permute_cuda)  //
    {PermuteImpl::kThreaded, detail::permute_threaded, on_cpu, kCpuNeeds},
    {PermuteImpl::kReference, detail::permute_ref, on_cpu, kCpuNeeds},
};
constexpr Implementation<PermuteImpl, detail::CombineProblem> kCombineImpls[] = {
    MOEKIT_CUDA_ENTRY(combine_cuda)  //
    {PermuteImpl::kThreaded, detail::combine_threaded, on_cpu, kCpuNeeds},
    {PermuteImpl::kReference, detail::combine_ref, on_cpu, kCpuNeeds},
};
constexpr Implementation<PermuteImpl, detail::ScatterProblem> kScatterImpls[] = {
    MOEKIT_CUDA_ENTRY(scatter_cuda)  //
    {PermuteImpl::kThreaded, detail::scatter_threaded, on_cpu, kCpuNeeds},
    {PermuteImpl::kReference, detail::scatter_ref, on_cpu, kCpuNeeds},
};
constexpr Implementation<PermuteImpl, detail::SortChunksProblem> kSortChunksImpls[] = {
    MOEKIT_CUDA_ENTRY(sort_chunks_cuda)  //
    {PermuteImpl::kThreaded, detail::sort_chunks_threaded, on_cpu, kCpuNeeds},
    {PermuteImpl::kReference, detail::sort_chunks_ref, on_cpu, kCpuNeeds},
};
#undef MOEKIT_CUDA_ENTRY

// The most rows the permuted tensor can have: row_map indexes them with i32.
constexpr int64_t kMaxRows = std::numeric_limits<int32_t>::max();

// ceil(T * k / E * capacity_factor), or -1 without a capacity. A capacity above kMaxRows is
// kMaxRows + 1: it keeps every slot an expert can hold, and padded to, no block fits, as with
// the exact value (which need not fit int64: capacity_factor may be 1e300).
int64_t capacity_of(int64_t T, int64_t k, int64_t E, double capacity_factor) {
  if (capacity_factor == 0.0) return -1;
  const double c = std::ceil(static_cast<double>(T) * static_cast<double>(k) /
                             static_cast<double>(E) * capacity_factor);
  return c > static_cast<double>(kMaxRows) ? kMaxRows + 1 : static_cast<int64_t>(c);
}

// round_up (check.h) below takes n < 2^62 and a in [1, kMaxRows]: it cannot overflow.

Status check_options(const char* op, const PermuteOptions& o) {
  if (o.align_size < 1 || o.align_size > kMaxRows) {
    return Status::invalid_argument(op, "align_size", std::to_string(o.align_size),
                                    "must be in [1, 2^31 - 1] (1: no padding)");
  }
  if (!(o.capacity_factor >= 0.0) || !std::isfinite(o.capacity_factor)) {
    return Status::invalid_argument(op, "capacity_factor", fmt::format("{}", o.capacity_factor),
                                    "must be finite and >= 0 (0: dropless)");
  }
  if (o.drop_policy != DropPolicy::kProbs && o.drop_policy != DropPolicy::kPosition) {
    return Status::invalid_argument(
        op, "drop_policy", std::to_string(static_cast<int>(o.drop_policy)), "not a DropPolicy");
  }
  if (o.pad_to_capacity && o.capacity_factor == 0.0) {
    return Status::invalid_argument(op, "pad_to_capacity", "true", "needs a capacity_factor > 0");
  }
  if (o.k < 0) return Status::invalid_argument(op, "k", std::to_string(o.k), "must be >= 0");
  return {};
}

// An i32 [2, T, S] row map whose row indices lie in [-1, N) (read where the host can: for host
// buffers; the CUDA kernels take a row outside as -1).
Status check_row_map(const char* op, const ConstTensorView& row_map, int64_t N, const Exec& exec) {
  MOEKIT_RETURN_IF_ERROR(check_view(op, "row_map", row_map, 3));
  MOEKIT_RETURN_IF_ERROR(check_dtype(op, "row_map", row_map.dtype, DType::kI32));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "row_map", row_map, 0, 2, "2 (rows, experts)"));
  if (exec.device != Device::kCpu) return {};
  const auto* base = static_cast<const int32_t*>(row_map.data);
  for (int64_t t = 0; t < row_map.shape[1]; ++t) {
    const int32_t* rows = base + t * row_map.stride[1];
    for (int64_t s = 0; s < row_map.shape[2]; ++s) {
      if (rows[s] < -1 || rows[s] >= N) {
        return Status::invalid_argument(
            op, fmt::format("row_map[0, {}, {}]", t, s), std::to_string(rows[s]),
            fmt::format("must be -1 or a row in [0, {}) of the permuted tensor", N));
      }
    }
  }
  return {};
}

// A [T, S] per-slot tensor (f32 | bf16) when present.
Status check_slots(const char* op, const char* name, const ConstTensorView& v, int64_t T,
                   int64_t S) {
  if (!present(v)) return {};
  MOEKIT_RETURN_IF_ERROR(check_matrix(op, name, v, T, "T", S, "S (row_map.shape[2])"));
  return check_input_dtype(op, name, v.dtype);
}

// A [N] vector of f32 | bf16.
Status check_row_vector(const char* op, const char* name, const ConstTensorView& v, int64_t N,
                        const char* what) {
  MOEKIT_RETURN_IF_ERROR(check_view(op, name, v, 1));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, name, v, 0, N, what));
  return check_input_dtype(op, name, v.dtype);
}

}  // namespace

namespace detail {

BlockLayout block_layout(const std::vector<int64_t>& routed, int64_t capacity, int64_t align,
                         bool pad_to_capacity) {
  const size_t E = routed.size();
  BlockLayout b;
  b.kept.resize(E);
  b.rows.resize(E);
  b.start.resize(E);
  // needed stops at 2^62, far past the rows permute accepts: no sum of blocks can wrap.
  constexpr int64_t kStop = int64_t{1} << 62;
  for (size_t e = 0; e < E; ++e) {
    b.kept[e] = capacity < 0 ? routed[e] : std::min(routed[e], capacity);
    b.rows[e] = round_up(pad_to_capacity ? capacity : b.kept[e], align);
    b.start[e] = b.needed;
    b.needed = std::min(b.needed + b.rows[e], kStop);
  }
  return b;
}

}  // namespace detail

int64_t permute_max_rows(int64_t T, int64_t E, int32_t k, const PermuteOptions& o) {
  if (T < 0 || E < 1 || E > kMaxRows || k < 1 || !check_options("permute_max_rows", o).ok()) {
    return -1;
  }
  // In 128 bits, where none of these products of int64 and int32 values can wrap.
  using Wide = __int128;
  const Wide a = o.align_size, routed = Wide{T} * k, experts = E;
  const int64_t capacity = capacity_of(T, k, E, o.capacity_factor);
  Wide rows = 0;
  if (capacity < 0) {
    rows = (routed + experts * (a - 1)) / a * a;
  } else {
    const Wide per_expert = round_up(capacity, o.align_size);
    const Wide kept = std::min(routed, experts * capacity);
    rows = o.pad_to_capacity ? experts * per_expert
                             : std::min(experts * per_expert, (kept + experts * (a - 1)) / a * a);
  }
  return rows > kMaxRows ? -1 : static_cast<int64_t>(rows);
}

Status permute(ConstTensorView x, ConstTensorView routing, ConstTensorView probs,
               const PermuteOptions& options, const PermuteOutputs& out, const Exec& exec) {
  const char* op = "permute";
  MOEKIT_RETURN_IF_ERROR(detail::check_exec(op, exec));
  MOEKIT_RETURN_IF_ERROR(check_options(op, options));
  detail::PermuteProblem p;
  p.options = options;
  p.out = out;
  p.exec = exec;

  // Sizes: E from tokens_per_expert, T and S from the routing.
  MOEKIT_RETURN_IF_ERROR(check_view(op, "tokens_per_expert", out.tokens_per_expert, 1));
  MOEKIT_RETURN_IF_ERROR(
      check_dtype(op, "tokens_per_expert", out.tokens_per_expert.dtype, DType::kI32));
  p.E = out.tokens_per_expert.shape[0];
  if (p.E < 1 || p.E > kMaxRows) {
    return Status::invalid_argument(op, "tokens_per_expert.shape",
                                    detail::shape_str(out.tokens_per_expert),
                                    "needs 1 to 2^31 - 1 experts (indices are i32)");
  }
  MOEKIT_RETURN_IF_ERROR(check_view(op, "routing", routing, 2));
  p.T = routing.shape[0];
  p.S = routing.shape[1];
  p.routing = routing;
  int64_t k = 0;
  if (routing.dtype == DType::kI32) {
    k = p.S;
    if (k < 1) {
      return Status::invalid_argument(op, "routing.shape", detail::shape_str(routing),
                                      "topk_indices need k >= 1 columns");
    }
  } else if (routing.dtype == DType::kBool) {
    MOEKIT_RETURN_IF_ERROR(check_dim(op, "routing", routing, 1, p.E, "E (tokens_per_expert)"));
    k = options.k;
    if (options.capacity_factor > 0.0 && k < 1) {
      return Status::invalid_argument(op, "k", std::to_string(options.k),
                                      "a capacity with a routing map needs k >= 1");
    }
  } else {
    return Status::invalid_argument(op, "routing.dtype", std::string(dtype_name(routing.dtype)),
                                    "expected i32 topk_indices or a bool routing_map");
  }

  // x and the permuted rows: both present, or both absent (plan only).
  if (present(x) != present(out.x)) {
    return Status::invalid_argument(op, present(x) ? "out.x" : "x", "absent",
                                    "x and out.x are given together or not at all");
  }
  if (present(x)) {
    MOEKIT_RETURN_IF_ERROR(check_view(op, "x", x, 2));
    MOEKIT_RETURN_IF_ERROR(check_dim(op, "x", x, 0, p.T, "T (routing.shape[0])"));
    MOEKIT_RETURN_IF_ERROR(check_input_dtype(op, "x", x.dtype));
    p.H = x.shape[1];
    MOEKIT_RETURN_IF_ERROR(check_view(op, "out.x", out.x, 2));
    MOEKIT_RETURN_IF_ERROR(check_dim(op, "out.x", out.x, 1, p.H, "H (x.shape[1])"));
    MOEKIT_RETURN_IF_ERROR(check_same_dtype(op, "out.x", out.x.dtype, "x", x.dtype));
    p.x = x;
  }
  if (present(probs)) {
    MOEKIT_RETURN_IF_ERROR(check_matrix(op, "probs", probs, p.T, "T", p.S, "S (routing.shape[1])"));
    MOEKIT_RETURN_IF_ERROR(check_input_dtype(op, "probs", probs.dtype));
    p.probs = probs;
  }
  if (present(out.probs)) {
    if (!present(probs)) {
      return Status::invalid_argument(op, "out.probs", "present", "needs probs to permute");
    }
    if (!present(out.x)) {
      return Status::invalid_argument(op, "out.probs", "present", "needs out.x (its rows)");
    }
    MOEKIT_RETURN_IF_ERROR(check_view(op, "out.probs", out.probs, 1));
    MOEKIT_RETURN_IF_ERROR(check_dim(op, "out.probs", out.probs, 0, out.x.shape[0], "out.x rows"));
    MOEKIT_RETURN_IF_ERROR(
        check_same_dtype(op, "out.probs", out.probs.dtype, "probs", probs.dtype));
  }
  if (options.capacity_factor > 0.0 && options.drop_policy == DropPolicy::kProbs &&
      !present(probs)) {
    return Status::invalid_argument(op, "probs", "absent",
                                    "the capacity policy kProbs drops by probs; pass them or use "
                                    "kPosition");
  }
  MOEKIT_RETURN_IF_ERROR(check_view(op, "row_map", out.row_map, 3));
  MOEKIT_RETURN_IF_ERROR(check_dtype(op, "row_map", out.row_map.dtype, DType::kI32));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "row_map", out.row_map, 0, 2, "2 (rows, experts)"));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "row_map", out.row_map, 1, p.T, "T"));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "row_map", out.row_map, 2, p.S, "S (routing.shape[1])"));
  if (present(out.pad_offsets)) {
    MOEKIT_RETURN_IF_ERROR(check_view(op, "pad_offsets", out.pad_offsets, 1));
    MOEKIT_RETURN_IF_ERROR(check_dtype(op, "pad_offsets", out.pad_offsets.dtype, DType::kI32));
    MOEKIT_RETURN_IF_ERROR(check_dim(op, "pad_offsets", out.pad_offsets, 0, p.E, "E"));
  }

  p.capacity = capacity_of(p.T, k, p.E, options.capacity_factor);
  const detail::Region outputs[] = {{"out.x", out.x},
                                    {"out.probs", out.probs},
                                    {"out.tokens_per_expert", out.tokens_per_expert},
                                    {"out.row_map", out.row_map},
                                    {"out.pad_offsets", out.pad_offsets}};
  const detail::Region inputs[] = {{"x", x}, {"routing", routing}, {"probs", probs}};
  if (exec.device != Device::kCpu) {
    // The device counts the routing: the buffer must hold the worst case, which a routing map
    // bounds by options.k ones per row.
    if (routing.dtype == DType::kBool && k < 1) {
      return Status::invalid_argument(op, "k", std::to_string(options.k),
                                      "a routing map on CUDA needs k >= 1 (the most ones of a "
                                      "row), which sizes the permuted buffer");
    }
    int64_t slots = 0;
    if (!detail::mul_fits(p.T, p.S, &slots) || slots > kMaxRows) {
      return Status::invalid_argument(op, "routing.shape", detail::shape_str(routing),
                                      "on CUDA, T * S slots must fit in i32");
    }
    const int64_t bound = permute_max_rows(p.T, p.E, static_cast<int32_t>(k), options);
    if (bound < 0) {
      return Status::invalid_argument(op, "routing", fmt::format("{} tokens x {} experts", p.T, k),
                                      "the permuted rows must be indexable by i32 (row_map)");
    }
    if (present(out.x) && out.x.shape[0] < bound) {
      return Status::invalid_argument(
          op, "out.x.shape", detail::shape_str(out.x),
          fmt::format("on CUDA needs permute_max_rows = {} rows (the device counts the routing)",
                      bound));
    }
    MOEKIT_RETURN_IF_ERROR(detail::check_disjoint(op, outputs, inputs));
    return run_implementation(op, kPermuteImpls, options.impl, p);
  }

  // Every index, and the routed count per expert.
  std::vector<int64_t> routed(p.E, 0);
  for (int64_t t = 0; t < p.T; ++t) {
    for (int64_t s = 0; s < p.S; ++s) {
      const int32_t e = detail::slot_expert(routing, t, s);
      if (e < 0 && routing.dtype == DType::kBool) continue;
      if (e < 0 || e >= p.E) {
        return Status::invalid_argument(op, fmt::format("topk_indices[{}, {}]", t, s),
                                        std::to_string(e),
                                        fmt::format("must be an expert in [0, {})", p.E));
      }
      ++routed[e];
    }
  }
  p.layout = detail::block_layout(routed, p.capacity, options.align_size, options.pad_to_capacity);
  if (p.layout.needed > kMaxRows) {
    return Status::invalid_argument(op, "routing", fmt::format("{} rows", p.layout.needed),
                                    "the permuted rows must be indexable by i32 (row_map)");
  }
  for (int64_t e = 0; e < p.E; ++e) {
    if (p.layout.rows[e] > kMaxRows) {
      return Status::invalid_argument(op, fmt::format("tokens_per_expert[{}]", e),
                                      std::to_string(p.layout.rows[e]), "does not fit in i32");
    }
  }
  if (present(out.x) && out.x.shape[0] < p.layout.needed) {
    return Status::invalid_argument(
        op, "out.x.shape", detail::shape_str(out.x),
        fmt::format("the routing needs {} rows (num_out_tokens too small; permute_max_rows gives "
                    "a size that always fits)",
                    p.layout.needed));
  }
  MOEKIT_RETURN_IF_ERROR(detail::check_disjoint(op, outputs, inputs));
  return run_implementation(op, kPermuteImpls, options.impl, p);
}

Status unpermute(ConstTensorView y_perm, ConstTensorView row_map, ConstTensorView merging_probs,
                 TensorView out, PermuteImpl impl, const Exec& exec) {
  const char* op = "unpermute";
  MOEKIT_RETURN_IF_ERROR(detail::check_exec(op, exec));
  MOEKIT_RETURN_IF_ERROR(check_view(op, "y_perm", y_perm, 2));
  MOEKIT_RETURN_IF_ERROR(check_input_dtype(op, "y_perm", y_perm.dtype));
  MOEKIT_RETURN_IF_ERROR(check_row_map(op, row_map, y_perm.shape[0], exec));
  const int64_t T = row_map.shape[1], S = row_map.shape[2];
  MOEKIT_RETURN_IF_ERROR(check_slots(op, "merging_probs", merging_probs, T, S));
  MOEKIT_RETURN_IF_ERROR(check_matrix(op, "out", out, T, "T (row_map.shape[1])", y_perm.shape[1],
                                      "H (y_perm.shape[1])"));
  MOEKIT_RETURN_IF_ERROR(check_output_dtype(op, "out", out.dtype, y_perm.dtype));
  MOEKIT_RETURN_IF_ERROR(detail::check_disjoint(
      op, {{"out", out}},
      {{"y_perm", y_perm}, {"row_map", row_map}, {"merging_probs", merging_probs}}));
  detail::CombineProblem p{y_perm, row_map, merging_probs, out, {}, {}, exec};
  return run_implementation(op, kCombineImpls, impl, p);
}

Status permute_backward(ConstTensorView d_x_perm, ConstTensorView d_probs_perm,
                        ConstTensorView row_map, TensorView d_x, TensorView d_probs,
                        PermuteImpl impl, const Exec& exec) {
  const char* op = "permute_backward";
  MOEKIT_RETURN_IF_ERROR(detail::check_exec(op, exec));
  MOEKIT_RETURN_IF_ERROR(check_view(op, "d_x_perm", d_x_perm, 2));
  MOEKIT_RETURN_IF_ERROR(check_input_dtype(op, "d_x_perm", d_x_perm.dtype));
  const int64_t N = d_x_perm.shape[0];
  MOEKIT_RETURN_IF_ERROR(check_row_map(op, row_map, N, exec));
  const int64_t T = row_map.shape[1], S = row_map.shape[2];
  MOEKIT_RETURN_IF_ERROR(check_matrix(op, "d_x", d_x, T, "T (row_map.shape[1])", d_x_perm.shape[1],
                                      "H (d_x_perm.shape[1])"));
  MOEKIT_RETURN_IF_ERROR(check_output_dtype(op, "d_x", d_x.dtype, d_x_perm.dtype));
  if (present(d_probs) != present(d_probs_perm)) {
    return Status::invalid_argument(op, present(d_probs) ? "d_probs_perm" : "d_probs", "absent",
                                    "d_probs_perm and d_probs are given together or not at all");
  }
  if (present(d_probs)) {
    MOEKIT_RETURN_IF_ERROR(check_row_vector(op, "d_probs_perm", d_probs_perm, N, "d_x_perm rows"));
    MOEKIT_RETURN_IF_ERROR(check_matrix(op, "d_probs", d_probs, T, "T", S, "S (row_map.shape[2])"));
    MOEKIT_RETURN_IF_ERROR(check_output_dtype(op, "d_probs", d_probs.dtype, d_probs_perm.dtype));
  }
  MOEKIT_RETURN_IF_ERROR(detail::check_disjoint(
      op, {{"d_x", d_x}, {"d_probs", d_probs}},
      {{"d_x_perm", d_x_perm}, {"d_probs_perm", d_probs_perm}, {"row_map", row_map}}));
  detail::CombineProblem p{d_x_perm, row_map, {}, d_x, d_probs_perm, d_probs, exec};
  return run_implementation(op, kCombineImpls, impl, p);
}

Status unpermute_backward(ConstTensorView d_out, ConstTensorView y_perm, ConstTensorView row_map,
                          ConstTensorView merging_probs, TensorView d_y_perm,
                          TensorView d_merging_probs, PermuteImpl impl, const Exec& exec) {
  const char* op = "unpermute_backward";
  MOEKIT_RETURN_IF_ERROR(detail::check_exec(op, exec));
  MOEKIT_RETURN_IF_ERROR(check_view(op, "d_y_perm", d_y_perm, 2));
  const int64_t N = d_y_perm.shape[0];
  MOEKIT_RETURN_IF_ERROR(check_row_map(op, row_map, N, exec));
  const int64_t T = row_map.shape[1], S = row_map.shape[2];
  MOEKIT_RETURN_IF_ERROR(check_view(op, "d_out", d_out, 2));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "d_out", d_out, 0, T, "T (row_map.shape[1])"));
  MOEKIT_RETURN_IF_ERROR(check_input_dtype(op, "d_out", d_out.dtype));
  const int64_t H = d_out.shape[1];
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "d_y_perm", d_y_perm, 1, H, "H (d_out.shape[1])"));
  MOEKIT_RETURN_IF_ERROR(check_output_dtype(op, "d_y_perm", d_y_perm.dtype, d_out.dtype));
  MOEKIT_RETURN_IF_ERROR(check_slots(op, "merging_probs", merging_probs, T, S));
  if (present(d_merging_probs)) {
    if (!present(y_perm)) {
      return Status::invalid_argument(op, "y_perm", "absent",
                                      "d_merging_probs needs the rows y_perm they weighted");
    }
    MOEKIT_RETURN_IF_ERROR(
        check_matrix(op, "d_merging_probs", d_merging_probs, T, "T", S, "S (row_map.shape[2])"));
    MOEKIT_RETURN_IF_ERROR(check_dtype(op, "d_merging_probs", d_merging_probs.dtype, DType::kF32));
  }
  if (present(y_perm)) {
    MOEKIT_RETURN_IF_ERROR(check_matrix(op, "y_perm", y_perm, N, "d_y_perm rows", H, "H"));
    MOEKIT_RETURN_IF_ERROR(check_input_dtype(op, "y_perm", y_perm.dtype));
  }
  MOEKIT_RETURN_IF_ERROR(
      detail::check_disjoint(op, {{"d_y_perm", d_y_perm}, {"d_merging_probs", d_merging_probs}},
                             {{"d_out", d_out},
                              {"y_perm", y_perm},
                              {"row_map", row_map},
                              {"merging_probs", merging_probs}}));
  detail::ScatterProblem p{d_out,    y_perm,          row_map, merging_probs,
                           d_y_perm, d_merging_probs, {},      exec};
  if (exec.device != Device::kCpu) return run_implementation(op, kScatterImpls, impl, p);
  // Each row of d_y_perm may be named once: a second writer would race.
  p.used.assign(N, 0);
  const auto* base = static_cast<const int32_t*>(row_map.data);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t s = 0; s < S; ++s) {
      const int32_t r = base[t * row_map.stride[1] + s];
      if (r < 0) continue;
      if (p.used[r]) {
        return Status::invalid_argument(op, fmt::format("row_map[0, {}, {}]", t, s),
                                        std::to_string(r),
                                        "names a row another slot already names");
      }
      p.used[r] = 1;
    }
  }
  return run_implementation(op, kScatterImpls, impl, p);
}

Status sort_chunks_by_index(ConstTensorView x, ConstTensorView split_sizes,
                            ConstTensorView sorted_index, bool inverse, TensorView out,
                            ConstTensorView probs, TensorView out_probs, PermuteImpl impl,
                            const Exec& exec) {
  const char* op = "sort_chunks_by_index";
  MOEKIT_RETURN_IF_ERROR(detail::check_exec(op, exec));
  MOEKIT_RETURN_IF_ERROR(check_view(op, "x", x, 2));
  MOEKIT_RETURN_IF_ERROR(check_input_dtype(op, "x", x.dtype));
  const int64_t N = x.shape[0];
  MOEKIT_RETURN_IF_ERROR(check_matrix(op, "out", out, N, "N (x.shape[0])", x.shape[1], "H"));
  MOEKIT_RETURN_IF_ERROR(check_same_dtype(op, "out", out.dtype, "x", x.dtype));
  MOEKIT_RETURN_IF_ERROR(check_view(op, "split_sizes", split_sizes, 1));
  MOEKIT_RETURN_IF_ERROR(check_dtype(op, "split_sizes", split_sizes.dtype, DType::kI32));
  const int64_t C = split_sizes.shape[0];
  MOEKIT_RETURN_IF_ERROR(check_view(op, "sorted_index", sorted_index, 1));
  MOEKIT_RETURN_IF_ERROR(check_dtype(op, "sorted_index", sorted_index.dtype, DType::kI32));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "sorted_index", sorted_index, 0, C, "C (split_sizes)"));
  if (present(probs) != present(out_probs)) {
    return Status::invalid_argument(op, present(probs) ? "out_probs" : "probs", "absent",
                                    "probs and out_probs are given together or not at all");
  }
  if (present(probs)) {
    MOEKIT_RETURN_IF_ERROR(check_row_vector(op, "probs", probs, N, "N (x.shape[0])"));
    MOEKIT_RETURN_IF_ERROR(check_view(op, "out_probs", out_probs, 1));
    MOEKIT_RETURN_IF_ERROR(check_dim(op, "out_probs", out_probs, 0, N, "N"));
    MOEKIT_RETURN_IF_ERROR(
        check_same_dtype(op, "out_probs", out_probs.dtype, "probs", probs.dtype));
  }
  MOEKIT_RETURN_IF_ERROR(detail::check_disjoint(
      op, {{"out", out}, {"out_probs", out_probs}},
      {{"x", x}, {"split_sizes", split_sizes}, {"sorted_index", sorted_index}, {"probs", probs}}));
  detail::SortChunksProblem p{x,  out, probs,       out_probs,    {},      {},
                              {}, 0,   split_sizes, sorted_index, inverse, exec};
  if (exec.device != Device::kCpu) return run_implementation(op, kSortChunksImpls, impl, p);
  const auto* sizes = static_cast<const int32_t*>(split_sizes.data);
  const auto* index = static_cast<const int32_t*>(sorted_index.data);
  std::vector<int64_t> offset(C);
  for (int64_t c = 0; c < C; ++c) {
    if (sizes[c] < 0) {
      return Status::invalid_argument(op, fmt::format("split_sizes[{}]", c),
                                      std::to_string(sizes[c]), "must be >= 0");
    }
    offset[c] = p.chunk_rows;
    p.chunk_rows += sizes[c];
  }
  if (p.chunk_rows > N) {
    return Status::invalid_argument(op, "split_sizes", fmt::format("sum {}", p.chunk_rows),
                                    fmt::format("must be <= the {} rows of x", N));
  }
  std::vector<uint8_t> seen(C, 0);
  for (int64_t i = 0; i < C; ++i) {
    if (index[i] < 0 || index[i] >= C || seen[index[i]]) {
      return Status::invalid_argument(op, fmt::format("sorted_index[{}]", i),
                                      std::to_string(index[i]),
                                      fmt::format("must make a permutation of [0, {})", C));
    }
    seen[index[i]] = 1;
  }
  // Output chunk i is input chunk index[i]; the inverse moves it back.
  int64_t at = 0;
  for (int64_t i = 0; i < C; ++i) {
    const int64_t c = index[i];
    p.src.push_back(inverse ? at : offset[c]);
    p.dst.push_back(inverse ? offset[c] : at);
    p.size.push_back(sizes[c]);
    at += sizes[c];
  }
  return run_implementation(op, kSortChunksImpls, impl, p);
}

size_t permute_workspace_size(Device device, int64_t tokens, int64_t slots, int64_t experts,
                              int64_t rows) {
  if (tokens < 0 || slots < 0 || experts < 0 || rows < 0) return SIZE_MAX;
  if (device != Device::kCuda) return 0;
#if MOEKIT_HAS_CUDA
  return cu::permute_workspace_bytes(tokens, slots, experts, rows);
#else
  return 0;
#endif
}

const char* impl_name(PermuteImpl impl) {
  switch (impl) {
    case PermuteImpl::kAuto:
      return "auto";
    case PermuteImpl::kCuda:
      return "cuda";
    case PermuteImpl::kThreaded:
      return "threaded";
    case PermuteImpl::kReference:
      return "reference";
  }
  return "unknown";
}

}  // namespace moekit
