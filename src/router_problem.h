// Internal: the router problems after validation (src/router.cpp), as every implementation takes
// them: the CPU's (cpu/router/problems.h) and the CUDA one (cuda/router_cuda.h). Each carries the
// call's execution context; its tensors live where exec.device says. Absent optional tensors have
// data == nullptr here.
#pragma once

#include <cstdint>

#include "moekit/exec.h"
#include "moekit/router.h"

namespace moekit::detail {

// The 1e-20 that keeps a normalisation by a sum of sigmoid scores finite (SPEC section 2).
inline constexpr float kNormEps = 1e-20f;

// The most experts a row may have in the CUDA router's kernels (32 lanes x 32 registers); more
// is kUnimplemented there.
inline constexpr int64_t kRouterMaxCudaExperts = 1024;

struct RouteProblem {
  ConstTensorView logits;  // [T, E]
  RouteOptions options;    // validated; expert_bias empty or [E]
  RouteOutputs out;        // absent outputs: data == nullptr
  Exec exec;
};

struct RouteBackwardProblem {
  ConstTensorView logits;  // [T, E]
  // [T, k] i32: on the CPU every index in [0, E); on CUDA unchecked (outside: no gradient)
  ConstTensorView topk_indices;
  ConstTensorView d_probs;         // [T, E] or absent
  ConstTensorView d_topk_weights;  // [T, k] or absent
  RouteOptions options;
  TensorView d_logits;  // [T, E]
  Exec exec;
};

struct AuxScoresProblem {
  ConstTensorView logits;  // [T, E]
  int32_t k;
  RouterScore score;
  TensorView scores;       // [T, E] f32 or absent
  TensorView routing_map;  // [T, E] bool or absent
  Exec exec;
};

struct AuxScoresBackwardProblem {
  ConstTensorView logits;    // [T, E]
  ConstTensorView d_scores;  // [T, E]
  RouterScore score;
  TensorView d_logits;  // [T, E]
  Exec exec;
};

// The load-balancing loss, batch or per sequence: *loss = scale * sum_t <scores[t],
// tokens_per_expert[b(t)]>, row t in sequence b(t) = t / (T / B).
struct BalanceLossProblem {
  ConstTensorView scores;             // [T, E] f32 | bf16
  ConstTensorView tokens_per_expert;  // [B, E] i32 (rank 1: B = 1)
  double scale;                       // E * coeff / (k * T_total^2), over B per sequence
  float* loss;
  Exec exec;
};

// d_scores[t, e] = scale * tokens_per_expert[b(t), e].
struct BalanceBackwardProblem {
  ConstTensorView tokens_per_expert;  // [B, E] i32 (rank 1: B = 1)
  float scale;                        // the forward's scale times d_loss
  TensorView d_scores;                // [T, E]
  Exec exec;
};

// *loss = scale * sum_t logsumexp(logits[t])^2, scale = coeff / T (0 rows, or E = 0: 0).
struct ZLossProblem {
  ConstTensorView logits;  // [T, E]
  double scale;
  float* loss;
  Exec exec;
};

// d_logits[t] = scale * logsumexp(logits[t]) * softmax(logits[t]), scale = 2 coeff d_loss / T.
struct ZLossBackwardProblem {
  ConstTensorView logits;  // [T, E], T, E >= 1
  float scale;
  TensorView d_logits;
  Exec exec;
};

// counts[b, e] = the ones of routing_map's column e in sequence b.
struct CountProblem {
  ConstTensorView routing_map;  // [T, E] bool
  TensorView counts;            // [B, E] i32 (rank 1: B = 1), B divides T
  Exec exec;
};

// expert_bias[e] += rate * sign(mean(tokens_per_expert) - tokens_per_expert[e]).
struct BiasUpdateProblem {
  ConstTensorView tokens_per_expert;  // [E] i32
  float rate;
  TensorView expert_bias;  // [E] f32, E >= 1
  Exec exec;
};

}  // namespace moekit::detail
