// Public router entry points: validate every argument (nothing is written before this is done),
// build the problem of router_problem.h, and run the first implementation of its table that
// takes it: the CUDA kernels for CUDA buffers where moekit is built with them, the CPU's
// vectorised code, the scalar reference last. What only the device holds (indices, counts) is
// checked on the host for host buffers only.
#include "moekit/router.h"

#include <fmt/format.h>

#include <cmath>
#include <string>

#include "check.h"
#include "cpu/router/problems.h"
#include "impl_table.h"
#if MOEKIT_HAS_CUDA
#include "cuda/router_cuda.h"
#endif

namespace moekit {
namespace {

using detail::check_dim;
using detail::check_dtype;
using detail::check_input_dtype;
using detail::check_matrix;
using detail::check_output_dtype;
using detail::check_view;
using detail::Implementation;
using detail::kCpuNeeds;
using detail::kCudaNeeds;
using detail::on_cpu;
using detail::on_cuda;
using detail::present;
using detail::run_implementation;
#if MOEKIT_HAS_CUDA
namespace cu = detail::cuda;
// The first entry of every table where the build has CUDA.
#define MOEKIT_CUDA_ENTRY(fn) {RouterImpl::kCuda, cu::fn, on_cuda, kCudaNeeds},
#else
#define MOEKIT_CUDA_ENTRY(fn)
#endif

// Ordered fastest first, the reference last.
constexpr Implementation<RouterImpl, detail::RouteProblem> kRouteImpls[] = {
    MOEKIT_CUDA_ENTRY(route_cuda)  //
    {RouterImpl::kVectorized, detail::route_vectorized, on_cpu, kCpuNeeds},
    {RouterImpl::kReference, detail::route_ref, on_cpu, kCpuNeeds},
};
constexpr Implementation<RouterImpl, detail::RouteBackwardProblem> kRouteBackwardImpls[] = {
    MOEKIT_CUDA_ENTRY(route_backward_cuda)  //
    {RouterImpl::kVectorized, detail::route_backward_vectorized, on_cpu, kCpuNeeds},
    {RouterImpl::kReference, detail::route_backward_ref, on_cpu, kCpuNeeds},
};
constexpr Implementation<RouterImpl, detail::AuxScoresProblem> kAuxImpls[] = {
    MOEKIT_CUDA_ENTRY(aux_scores_cuda)  //
    {RouterImpl::kVectorized, detail::aux_scores_vectorized, on_cpu, kCpuNeeds},
    {RouterImpl::kReference, detail::aux_scores_ref, on_cpu, kCpuNeeds},
};
constexpr Implementation<RouterImpl, detail::AuxScoresBackwardProblem> kAuxBackwardImpls[] = {
    MOEKIT_CUDA_ENTRY(aux_scores_backward_cuda)  //
    {RouterImpl::kVectorized, detail::aux_scores_backward_vectorized, on_cpu, kCpuNeeds},
    {RouterImpl::kReference, detail::aux_scores_backward_ref, on_cpu, kCpuNeeds},
};
// The losses, the counts and the bias update have one CPU implementation each (it is the
// reference too: plain loops over rows).
constexpr Implementation<RouterImpl, detail::BalanceLossProblem> kBalanceImpls[] = {
    MOEKIT_CUDA_ENTRY(balance_loss_cuda)  //
    {RouterImpl::kVectorized, detail::balance_loss_cpu, on_cpu, kCpuNeeds},
};
constexpr Implementation<RouterImpl, detail::BalanceBackwardProblem> kBalanceBackwardImpls[] = {
    MOEKIT_CUDA_ENTRY(balance_loss_backward_cuda)  //
    {RouterImpl::kVectorized, detail::balance_loss_backward_cpu, on_cpu, kCpuNeeds},
};
constexpr Implementation<RouterImpl, detail::ZLossProblem> kZLossImpls[] = {
    MOEKIT_CUDA_ENTRY(z_loss_cuda)  //
    {RouterImpl::kVectorized, detail::z_loss_cpu, on_cpu, kCpuNeeds},
};
constexpr Implementation<RouterImpl, detail::ZLossBackwardProblem> kZLossBackwardImpls[] = {
    MOEKIT_CUDA_ENTRY(z_loss_backward_cuda)  //
    {RouterImpl::kVectorized, detail::z_loss_backward_cpu, on_cpu, kCpuNeeds},
};
constexpr Implementation<RouterImpl, detail::CountProblem> kCountImpls[] = {
    MOEKIT_CUDA_ENTRY(count_tokens_cuda)  //
    {RouterImpl::kVectorized, detail::count_tokens_cpu, on_cpu, kCpuNeeds},
};
constexpr Implementation<RouterImpl, detail::BiasUpdateProblem> kBiasImpls[] = {
    MOEKIT_CUDA_ENTRY(update_expert_bias_cuda)  //
    {RouterImpl::kVectorized, detail::update_expert_bias_cpu, on_cpu, kCpuNeeds},
};
#undef MOEKIT_CUDA_ENTRY

Status check_score(const char* op, RouterScore score) {
  switch (score) {
    case RouterScore::kSoftmax:
    case RouterScore::kSigmoid:
    case RouterScore::kSqrtSoftplus:
      return {};
  }
  return Status::invalid_argument(op, "score", std::to_string(static_cast<int>(score)),
                                  "not a RouterScore");
}

Status check_k(const char* op, int32_t k, int64_t E) {
  if (k >= 1 && k <= E) return {};
  return Status::invalid_argument(op, "k", std::to_string(k),
                                  fmt::format("must be in [1, E] = [1, {}]", E));
}

Status check_finite(const char* op, const char* name, float v) {
  if (std::isfinite(v)) return {};
  return Status::invalid_argument(op, name, fmt::format("{}", v), "must be finite");
}

// The options of route against E.
Status check_route_options(const char* op, const RouteOptions& o, int64_t E) {
  MOEKIT_RETURN_IF_ERROR(check_score(op, o.score));
  MOEKIT_RETURN_IF_ERROR(check_k(op, o.k, E));
  MOEKIT_RETURN_IF_ERROR(check_finite(op, "scaling_factor", o.scaling_factor));
  if (o.pre_softmax && o.score != RouterScore::kSoftmax) {
    return Status::invalid_argument(op, "pre_softmax", "true",
                                    "only the softmax score has a pre-softmax form");
  }
  if (o.num_groups < 0) {
    return Status::invalid_argument(op, "num_groups", std::to_string(o.num_groups),
                                    "must be >= 0 (0: no group-limited routing)");
  }
  if (o.num_groups == 0 && o.group_topk != 0) {
    return Status::invalid_argument(op, "group_topk", std::to_string(o.group_topk),
                                    "needs num_groups > 0");
  }
  if (o.num_groups > 0) {
    if (E % o.num_groups != 0) {
      return Status::invalid_argument(op, "num_groups", std::to_string(o.num_groups),
                                      fmt::format("must divide E = {}", E));
    }
    if (o.group_topk < 1 || o.group_topk > o.num_groups) {
      return Status::invalid_argument(
          op, "group_topk", std::to_string(o.group_topk),
          fmt::format("must be in [1, num_groups] = [1, {}]", o.num_groups));
    }
    if (o.k % o.group_topk != 0) {
      return Status::invalid_argument(op, "group_topk", std::to_string(o.group_topk),
                                      fmt::format("must divide k = {}", o.k));
    }
    if (o.k / o.group_topk > E / o.num_groups) {
      return Status::invalid_argument(
          op, "k", std::to_string(o.k),
          fmt::format("k / group_topk = {} must be <= the {} experts of a group",
                      o.k / o.group_topk, E / o.num_groups));
    }
  }
  if (!o.expert_bias.empty()) {
    if (o.score == RouterScore::kSoftmax) {
      return Status::invalid_argument(op, "expert_bias.size()",
                                      std::to_string(o.expert_bias.size()),
                                      "a bias is only used with sigmoid or sqrtsoftplus scores");
    }
    if (static_cast<int64_t>(o.expert_bias.size()) != E) {
      return Status::invalid_argument(op, "expert_bias.size()",
                                      std::to_string(o.expert_bias.size()),
                                      fmt::format("must be E = {}", E));
    }
    if (o.expert_bias.data() == nullptr) {
      return Status::invalid_argument(op, "expert_bias.data", "null", "non-empty span needs data");
    }
  }
  return {};
}

Status check_logits(const char* op, const char* name, const ConstTensorView& logits) {
  MOEKIT_RETURN_IF_ERROR(check_view(op, name, logits, 2));
  return check_input_dtype(op, name, logits.dtype);
}

// tokens_per_expert: [E] (rank 1) or [B, E] (rank 2) i32, every count >= 0 (read where the host
// can: for host buffers).
Status check_counts(const char* op, const ConstTensorView& tpe, int rank, int64_t E,
                    const Exec& exec) {
  MOEKIT_RETURN_IF_ERROR(check_view(op, "tokens_per_expert", tpe, rank));
  MOEKIT_RETURN_IF_ERROR(check_dtype(op, "tokens_per_expert", tpe.dtype, DType::kI32));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "tokens_per_expert", tpe, rank - 1, E, "E"));
  if (exec.device != Device::kCpu) return {};
  const int64_t B = rank == 2 ? tpe.shape[0] : 1;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* row = static_cast<const int32_t*>(tpe.data) + b * tpe.stride[0];
    for (int64_t e = 0; e < E; ++e) {
      if (row[e] < 0) {
        const std::string where = rank == 2 ? fmt::format("tokens_per_expert[{}, {}]", b, e)
                                            : fmt::format("tokens_per_expert[{}]", e);
        return Status::invalid_argument(op, where, std::to_string(row[e]), "counts must be >= 0");
      }
    }
  }
  return {};
}

Status check_loss_options(const char* op, const LoadBalancingOptions& o) {
  if (o.k < 1) {
    return Status::invalid_argument(op, "k", std::to_string(o.k), "must be >= 1");
  }
  MOEKIT_RETURN_IF_ERROR(check_finite(op, "coeff", o.coeff));
  if (o.total_tokens < 0) {
    return Status::invalid_argument(op, "total_tokens", std::to_string(o.total_tokens),
                                    "must be >= 0 (0: the local token count)");
  }
  return {};
}

Status check_loss_ptr(const char* op, const float* loss) {
  if (loss != nullptr) return {};
  return Status::invalid_argument(op, "loss", "null", "needs somewhere to write the loss");
}

// E * coeff / (k * T_total^2) for a batch of `local` tokens, or 0 when T_total is 0.
Status balance_scale(const char* op, const LoadBalancingOptions& o, int64_t local, int64_t E,
                     double* scale) {
  const int64_t total = o.total_tokens == 0 ? local : o.total_tokens;
  if (total < local) {
    return Status::invalid_argument(
        op, "total_tokens", std::to_string(o.total_tokens),
        fmt::format("must be >= the {} local tokens (or 0 for exactly those)", local));
  }
  *scale = total == 0 ? 0.0
                      : static_cast<double>(E) * o.coeff /
                            (static_cast<double>(o.k) * static_cast<double>(total) * total);
  return {};
}

// Sequences: B = tokens_per_expert.shape[0] must divide T.
Status check_sequences(const char* op, const ConstTensorView& tpe, int64_t T,
                       const LoadBalancingOptions& o) {
  if (tpe.shape[0] < 1 || T % tpe.shape[0] != 0) {
    return Status::invalid_argument(
        op, "tokens_per_expert.shape[0]", std::to_string(tpe.shape[0]),
        fmt::format("the number of sequences must be >= 1 and divide T = {}", T));
  }
  if (o.total_tokens != 0) {
    return Status::invalid_argument(op, "total_tokens", std::to_string(o.total_tokens),
                                    "must be 0: each sequence is its own batch");
  }
  return {};
}

// The checks shared by the load-balancing entry points, and the factor their row sums are
// scaled by: E * coeff / (k * T_total^2), over B for the per-sequence form.
//   rows  [T, E] f32 | bf16: scores, or d_scores for a backward
Status check_balance(const char* op, const char* rows_name, const ConstTensorView& rows,
                     const ConstTensorView& tpe, const LoadBalancingOptions& o, bool per_sequence,
                     const Exec& exec, double* scale) {
  MOEKIT_RETURN_IF_ERROR(detail::check_exec(op, exec));
  MOEKIT_RETURN_IF_ERROR(check_logits(op, rows_name, rows));
  MOEKIT_RETURN_IF_ERROR(check_loss_options(op, o));
  MOEKIT_RETURN_IF_ERROR(check_counts(op, tpe, per_sequence ? 2 : 1, rows.shape[1], exec));
  int64_t B = 1;
  if (per_sequence) {
    MOEKIT_RETURN_IF_ERROR(check_sequences(op, tpe, rows.shape[0], o));
    B = tpe.shape[0];
  }
  MOEKIT_RETURN_IF_ERROR(balance_scale(op, o, rows.shape[0] / B, rows.shape[1], scale));
  *scale /= static_cast<double>(B);
  return {};
}

// loss = scale * sum_t <scores[t], tokens_per_expert[sequence of t]>.
Status balance_forward(const char* op, const ConstTensorView& scores, const ConstTensorView& tpe,
                       const LoadBalancingOptions& o, float* loss, bool per_sequence,
                       const Exec& exec) {
  double scale;
  MOEKIT_RETURN_IF_ERROR(check_balance(op, "scores", scores, tpe, o, per_sequence, exec, &scale));
  MOEKIT_RETURN_IF_ERROR(check_loss_ptr(op, loss));
  MOEKIT_RETURN_IF_ERROR(detail::check_disjoint(op, {{"loss", loss, sizeof *loss}},
                                                {{"scores", scores}, {"tokens_per_expert", tpe}}));
  const detail::BalanceLossProblem p{scores, tpe, scale, loss, exec};
  return run_implementation(op, kBalanceImpls, RouterImpl::kAuto, p);
}

// d_scores[t, e] = scale * d_loss * tokens_per_expert[sequence of t].
Status balance_backward(const char* op, const ConstTensorView& tpe, const LoadBalancingOptions& o,
                        float d_loss, const TensorView& d_scores, bool per_sequence,
                        const Exec& exec) {
  double scale;
  MOEKIT_RETURN_IF_ERROR(
      check_balance(op, "d_scores", d_scores, tpe, o, per_sequence, exec, &scale));
  MOEKIT_RETURN_IF_ERROR(check_finite(op, "d_loss", d_loss));
  MOEKIT_RETURN_IF_ERROR(
      detail::check_disjoint(op, {{"d_scores", d_scores}}, {{"tokens_per_expert", tpe}}));
  if (d_scores.shape[0] == 0) return {};
  const detail::BalanceBackwardProblem p{tpe, static_cast<float>(scale * d_loss), d_scores, exec};
  return run_implementation(op, kBalanceBackwardImpls, RouterImpl::kAuto, p);
}

}  // namespace

Status route(ConstTensorView logits, const RouteOptions& options, const RouteOutputs& out,
             const Exec& exec) {
  const char* op = "route";
  MOEKIT_RETURN_IF_ERROR(detail::check_exec(op, exec));
  MOEKIT_RETURN_IF_ERROR(check_logits(op, "logits", logits));
  const int64_t T = logits.shape[0], E = logits.shape[1];
  MOEKIT_RETURN_IF_ERROR(check_route_options(op, options, E));
  const int64_t k = options.k;
  detail::RouteProblem p{logits, options, out, exec};
  if (present(out.probs)) {
    MOEKIT_RETURN_IF_ERROR(check_matrix(op, "probs", out.probs, T, "T", E, "E"));
    MOEKIT_RETURN_IF_ERROR(check_output_dtype(op, "probs", out.probs.dtype, logits.dtype));
  }
  if (present(out.routing_map)) {
    MOEKIT_RETURN_IF_ERROR(check_matrix(op, "routing_map", out.routing_map, T, "T", E, "E"));
    MOEKIT_RETURN_IF_ERROR(check_dtype(op, "routing_map", out.routing_map.dtype, DType::kBool));
  }
  if (present(out.topk_indices)) {
    MOEKIT_RETURN_IF_ERROR(check_matrix(op, "topk_indices", out.topk_indices, T, "T", k, "k"));
    MOEKIT_RETURN_IF_ERROR(check_dtype(op, "topk_indices", out.topk_indices.dtype, DType::kI32));
  }
  if (present(out.topk_weights)) {
    MOEKIT_RETURN_IF_ERROR(check_matrix(op, "topk_weights", out.topk_weights, T, "T", k, "k"));
    MOEKIT_RETURN_IF_ERROR(
        check_output_dtype(op, "topk_weights", out.topk_weights.dtype, logits.dtype));
  }
  MOEKIT_RETURN_IF_ERROR(
      detail::check_disjoint(op,
                             {{"probs", out.probs},
                              {"routing_map", out.routing_map},
                              {"topk_indices", out.topk_indices},
                              {"topk_weights", out.topk_weights}},
                             {{"logits", logits}, {"expert_bias", options.expert_bias}}));
  if (T == 0) return {};
  return run_implementation(op, kRouteImpls, options.impl, p);
}

Status route_backward(ConstTensorView logits, ConstTensorView topk_indices, ConstTensorView d_probs,
                      ConstTensorView d_topk_weights, const RouteOptions& options,
                      TensorView d_logits, const Exec& exec) {
  const char* op = "route_backward";
  MOEKIT_RETURN_IF_ERROR(detail::check_exec(op, exec));
  MOEKIT_RETURN_IF_ERROR(check_logits(op, "logits", logits));
  const int64_t T = logits.shape[0], E = logits.shape[1];
  MOEKIT_RETURN_IF_ERROR(check_route_options(op, options, E));
  const int64_t k = options.k;
  MOEKIT_RETURN_IF_ERROR(check_matrix(op, "topk_indices", topk_indices, T, "T", k, "k"));
  MOEKIT_RETURN_IF_ERROR(check_dtype(op, "topk_indices", topk_indices.dtype, DType::kI32));
  if (present(d_probs)) {
    MOEKIT_RETURN_IF_ERROR(check_matrix(op, "d_probs", d_probs, T, "T", E, "E"));
    MOEKIT_RETURN_IF_ERROR(check_input_dtype(op, "d_probs", d_probs.dtype));
  }
  if (present(d_topk_weights)) {
    MOEKIT_RETURN_IF_ERROR(check_matrix(op, "d_topk_weights", d_topk_weights, T, "T", k, "k"));
    MOEKIT_RETURN_IF_ERROR(check_input_dtype(op, "d_topk_weights", d_topk_weights.dtype));
  }
  MOEKIT_RETURN_IF_ERROR(check_matrix(op, "d_logits", d_logits, T, "T", E, "E"));
  MOEKIT_RETURN_IF_ERROR(check_output_dtype(op, "d_logits", d_logits.dtype, logits.dtype));
  MOEKIT_RETURN_IF_ERROR(detail::check_disjoint(op, {{"d_logits", d_logits}},
                                                {{"logits", logits},
                                                 {"topk_indices", topk_indices},
                                                 {"d_probs", d_probs},
                                                 {"d_topk_weights", d_topk_weights},
                                                 {"expert_bias", options.expert_bias}}));
  // A branch-free pass first (it vectorises); where it finds a bad index, the first is named.
  // Host buffers only: on CUDA an index outside [0, E) adds no gradient.
  const auto index_row = [&](int64_t t) {
    return static_cast<const int32_t*>(topk_indices.data) + t * topk_indices.stride[0];
  };
  const int64_t checked_rows = exec.device == Device::kCpu ? T : 0;
  bool any_bad = false;
#pragma omp parallel for reduction(|| : any_bad) if (T * k >= (1 << 16))
  for (int64_t t = 0; t < checked_rows; ++t) {
    const int32_t* row = index_row(t);
    bool bad = false;
    for (int64_t i = 0; i < k; ++i) bad |= static_cast<uint32_t>(row[i]) >= E;
    any_bad = any_bad || bad;
  }
  for (int64_t t = 0; t < T && any_bad; ++t) {
    const int32_t* row = index_row(t);
    for (int64_t i = 0; i < k; ++i) {
      if (row[i] < 0 || row[i] >= E) {
        return Status::invalid_argument(op, fmt::format("topk_indices[{}, {}]", t, i),
                                        std::to_string(row[i]),
                                        fmt::format("expert indices must be in [0, {})", E));
      }
    }
  }
  if (T == 0) return {};
  detail::RouteBackwardProblem p{logits,  topk_indices, d_probs, d_topk_weights,
                                 options, d_logits,     exec};
  return run_implementation(op, kRouteBackwardImpls, options.impl, p);
}

Status aux_loss_scores(ConstTensorView logits, int32_t k, RouterScore score, TensorView scores,
                       TensorView routing_map, RouterImpl impl, const Exec& exec) {
  const char* op = "aux_loss_scores";
  MOEKIT_RETURN_IF_ERROR(detail::check_exec(op, exec));
  MOEKIT_RETURN_IF_ERROR(check_logits(op, "logits", logits));
  const int64_t T = logits.shape[0], E = logits.shape[1];
  MOEKIT_RETURN_IF_ERROR(check_score(op, score));
  MOEKIT_RETURN_IF_ERROR(check_k(op, k, E));
  if (present(scores)) {
    MOEKIT_RETURN_IF_ERROR(check_matrix(op, "scores", scores, T, "T", E, "E"));
    MOEKIT_RETURN_IF_ERROR(check_dtype(op, "scores", scores.dtype, DType::kF32));
  }
  if (present(routing_map)) {
    MOEKIT_RETURN_IF_ERROR(check_matrix(op, "routing_map", routing_map, T, "T", E, "E"));
    MOEKIT_RETURN_IF_ERROR(check_dtype(op, "routing_map", routing_map.dtype, DType::kBool));
  }
  MOEKIT_RETURN_IF_ERROR(detail::check_disjoint(
      op, {{"scores", scores}, {"routing_map", routing_map}}, {{"logits", logits}}));
  if (T == 0) return {};
  detail::AuxScoresProblem p{logits, k, score, scores, routing_map, exec};
  return run_implementation(op, kAuxImpls, impl, p);
}

Status aux_loss_scores_backward(ConstTensorView logits, ConstTensorView d_scores, RouterScore score,
                                TensorView d_logits, RouterImpl impl, const Exec& exec) {
  const char* op = "aux_loss_scores_backward";
  MOEKIT_RETURN_IF_ERROR(detail::check_exec(op, exec));
  MOEKIT_RETURN_IF_ERROR(check_logits(op, "logits", logits));
  const int64_t T = logits.shape[0], E = logits.shape[1];
  MOEKIT_RETURN_IF_ERROR(check_score(op, score));
  MOEKIT_RETURN_IF_ERROR(check_matrix(op, "d_scores", d_scores, T, "T", E, "E"));
  MOEKIT_RETURN_IF_ERROR(check_input_dtype(op, "d_scores", d_scores.dtype));
  MOEKIT_RETURN_IF_ERROR(check_matrix(op, "d_logits", d_logits, T, "T", E, "E"));
  MOEKIT_RETURN_IF_ERROR(check_output_dtype(op, "d_logits", d_logits.dtype, logits.dtype));
  MOEKIT_RETURN_IF_ERROR(detail::check_disjoint(op, {{"d_logits", d_logits}},
                                                {{"logits", logits}, {"d_scores", d_scores}}));
  if (T == 0) return {};
  detail::AuxScoresBackwardProblem p{logits, d_scores, score, d_logits, exec};
  return run_implementation(op, kAuxBackwardImpls, impl, p);
}

Status count_tokens_per_expert(ConstTensorView routing_map, TensorView counts, const Exec& exec) {
  const char* op = "count_tokens_per_expert";
  MOEKIT_RETURN_IF_ERROR(detail::check_exec(op, exec));
  MOEKIT_RETURN_IF_ERROR(check_view(op, "routing_map", routing_map, 2));
  MOEKIT_RETURN_IF_ERROR(check_dtype(op, "routing_map", routing_map.dtype, DType::kBool));
  const int64_t T = routing_map.shape[0], E = routing_map.shape[1];
  if (counts.rank != 1 && counts.rank != 2) {
    return Status::invalid_argument(op, "counts.rank", std::to_string(counts.rank),
                                    "expected [E] or [B, E]");
  }
  MOEKIT_RETURN_IF_ERROR(check_view(op, "counts", counts, counts.rank));
  MOEKIT_RETURN_IF_ERROR(check_dtype(op, "counts", counts.dtype, DType::kI32));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "counts", counts, counts.rank - 1, E, "E"));
  const int64_t B = counts.rank == 2 ? counts.shape[0] : 1;
  if (B < 1 || T % B != 0) {
    return Status::invalid_argument(
        op, "counts.shape[0]", std::to_string(B),
        fmt::format("the number of sequences must be >= 1 and divide T = {}", T));
  }
  MOEKIT_RETURN_IF_ERROR(
      detail::check_disjoint(op, {{"counts", counts}}, {{"routing_map", routing_map}}));
  if (E == 0) return {};
  const detail::CountProblem p{routing_map, counts, exec};
  return run_implementation(op, kCountImpls, RouterImpl::kAuto, p);
}

Status load_balancing_loss(ConstTensorView scores, ConstTensorView tokens_per_expert,
                           const LoadBalancingOptions& options, float* loss, const Exec& exec) {
  return balance_forward("load_balancing_loss", scores, tokens_per_expert, options, loss, false,
                         exec);
}

Status load_balancing_loss_backward(ConstTensorView tokens_per_expert,
                                    const LoadBalancingOptions& options, float d_loss,
                                    TensorView d_scores, const Exec& exec) {
  return balance_backward("load_balancing_loss_backward", tokens_per_expert, options, d_loss,
                          d_scores, false, exec);
}

Status seq_load_balancing_loss(ConstTensorView scores, ConstTensorView tokens_per_expert,
                               const LoadBalancingOptions& options, float* loss, const Exec& exec) {
  return balance_forward("seq_load_balancing_loss", scores, tokens_per_expert, options, loss, true,
                         exec);
}

Status seq_load_balancing_loss_backward(ConstTensorView tokens_per_expert,
                                        const LoadBalancingOptions& options, float d_loss,
                                        TensorView d_scores, const Exec& exec) {
  return balance_backward("seq_load_balancing_loss_backward", tokens_per_expert, options, d_loss,
                          d_scores, true, exec);
}

Status z_loss(ConstTensorView logits, float coeff, float* loss, const Exec& exec) {
  const char* op = "z_loss";
  MOEKIT_RETURN_IF_ERROR(detail::check_exec(op, exec));
  MOEKIT_RETURN_IF_ERROR(check_logits(op, "logits", logits));
  MOEKIT_RETURN_IF_ERROR(check_finite(op, "coeff", coeff));
  MOEKIT_RETURN_IF_ERROR(check_loss_ptr(op, loss));
  MOEKIT_RETURN_IF_ERROR(
      detail::check_disjoint(op, {{"loss", loss, sizeof *loss}}, {{"logits", logits}}));
  const int64_t T = logits.shape[0];
  const detail::ZLossProblem p{logits, T == 0 ? 0.0 : coeff / static_cast<double>(T), loss, exec};
  return run_implementation(op, kZLossImpls, RouterImpl::kAuto, p);
}

Status z_loss_backward(ConstTensorView logits, float coeff, float d_loss, TensorView d_logits,
                       const Exec& exec) {
  const char* op = "z_loss_backward";
  MOEKIT_RETURN_IF_ERROR(detail::check_exec(op, exec));
  MOEKIT_RETURN_IF_ERROR(check_logits(op, "logits", logits));
  MOEKIT_RETURN_IF_ERROR(check_finite(op, "coeff", coeff));
  MOEKIT_RETURN_IF_ERROR(check_finite(op, "d_loss", d_loss));
  const int64_t T = logits.shape[0], E = logits.shape[1];
  MOEKIT_RETURN_IF_ERROR(check_matrix(op, "d_logits", d_logits, T, "T", E, "E"));
  MOEKIT_RETURN_IF_ERROR(check_output_dtype(op, "d_logits", d_logits.dtype, logits.dtype));
  MOEKIT_RETURN_IF_ERROR(
      detail::check_disjoint(op, {{"d_logits", d_logits}}, {{"logits", logits}}));
  if (T == 0 || E == 0) return {};
  const detail::ZLossBackwardProblem p{logits, static_cast<float>(2.0 * coeff * d_loss / T),
                                       d_logits, exec};
  return run_implementation(op, kZLossBackwardImpls, RouterImpl::kAuto, p);
}

Status update_expert_bias(ConstTensorView tokens_per_expert, float rate, TensorView expert_bias,
                          const Exec& exec) {
  const char* op = "update_expert_bias";
  MOEKIT_RETURN_IF_ERROR(detail::check_exec(op, exec));
  MOEKIT_RETURN_IF_ERROR(check_view(op, "expert_bias", expert_bias, 1));
  MOEKIT_RETURN_IF_ERROR(check_dtype(op, "expert_bias", expert_bias.dtype, DType::kF32));
  const int64_t E = expert_bias.shape[0];
  MOEKIT_RETURN_IF_ERROR(check_counts(op, tokens_per_expert, 1, E, exec));
  MOEKIT_RETURN_IF_ERROR(check_finite(op, "rate", rate));
  // expert_bias is updated in place; the counts are read beside it.
  MOEKIT_RETURN_IF_ERROR(detail::check_disjoint(op, {{"expert_bias", expert_bias}},
                                                {{"tokens_per_expert", tokens_per_expert}}));
  if (E == 0) return {};
  const detail::BiasUpdateProblem p{tokens_per_expert, rate, expert_bias, exec};
  return run_implementation(op, kBiasImpls, RouterImpl::kAuto, p);
}

size_t router_workspace_size(Device device, int64_t tokens, int64_t experts) {
  if (device != Device::kCuda || tokens <= 0 || experts <= 0) return 0;
#if MOEKIT_HAS_CUDA
  return cu::router_workspace_bytes(tokens);
#else
  return 0;
#endif
}

const char* impl_name(RouterImpl impl) {
  switch (impl) {
    case RouterImpl::kAuto:
      return "auto";
    case RouterImpl::kCuda:
      return "cuda";
    case RouterImpl::kVectorized:
      return "vectorized";
    case RouterImpl::kReference:
      return "reference";
  }
  return "unknown";
}

}  // namespace moekit
