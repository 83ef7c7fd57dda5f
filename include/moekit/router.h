// Router: top-k expert choice with softmax, sigmoid or sqrtsoftplus scores, group-limited
// routing, expert bias and scaling, plus the auxiliary load-balancing losses (SPEC.md section 2).
//
// Notation: T tokens, E experts, k experts per token, B sequences. Logits are f32 or bf16; all
// math runs in f32. Every call validates all of its arguments before it writes anything, and
// errors name the argument and its value (e.g. "route: k = 9: must be in [1, E] = [1, 8]").
//
// Optional tensors: a default-constructed view (rank 0, no data) means "absent". route writes
// only the outputs that are present; the backward passes sum the cotangents that are present.
//
// Every call takes an execution context last (moekit/exec.h): on the CPU by default; with
// Exec::device = kCuda every tensor, the expert bias and each loss result are device memory, and
// the call is queued on the stream without waiting for the GPU. What only the device holds is not
// checked on the host: route_backward's topk_indices (an index outside [0, E) adds no gradient)
// and the counts of the losses and of update_expert_bias (used as they are). The losses need a
// workspace there (router_workspace_size). Results on the GPU equal the CPU's up to f32 rounding
// (the same formulas; sums in another order); routing decisions are the same except where two
// selection scores differ by a rounding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "moekit/exec.h"
#include "moekit/status.h"
#include "moekit/view.h"

namespace moekit {

enum class RouterScore {
  kSoftmax,       // softmax, before (pre_softmax) or after (default) the top-k
  kSigmoid,       // s = sigmoid(x)
  kSqrtSoftplus,  // s = sqrt(softplus(x)) = sqrt(log(1 + exp(x)))
};

// Which implementation runs. kAuto takes the first that takes the call: on CUDA buffers the CUDA
// kernels (one warp per token; E <= 1024), on host buffers the vectorised, threaded one;
// kReference is the CPU's scalar reference the tests compare against.
enum class RouterImpl { kAuto, kCuda, kVectorized, kReference };
// "auto", "cuda", "vectorized", "reference" ("unknown" outside the enum), as the errors say it.
const char* impl_name(RouterImpl impl);

struct RouteOptions {
  int32_t k = 1;  // experts per token, in [1, E]
  RouterScore score = RouterScore::kSoftmax;
  // Softmax only. false (post, Mixtral/Qwen3): choose the top-k logits, weights = softmax over
  // those k. true (pre, DeepSeek-V2): softmax over all E, choose its top-k, weights = those
  // probabilities (not renormalised).
  bool pre_softmax = false;
  // Group-limited routing (DeepSeek-V3): the E experts form num_groups equal groups; a group
  // scores the sum of its top k / group_topk selection scores (scores + bias); only the experts
  // of the best group_topk groups can be chosen. 0 = off. Needs E % num_groups == 0,
  // k % group_topk == 0, group_topk <= num_groups and k / group_topk <= E / num_groups.
  int32_t num_groups = 0;
  int32_t group_topk = 0;
  float scaling_factor = 1.0f;  // multiplies the final weights
  // [E] f32, sigmoid and sqrtsoftplus only; empty = no bias. Added to the scores to choose the
  // experts, never used as a weight, and not differentiated (update it with
  // update_expert_bias). In the call's memory (device memory on CUDA).
  std::span<const float> expert_bias = {};
  RouterImpl impl = RouterImpl::kAuto;
};

// The outputs of route; each may be absent (default-constructed).
struct RouteOutputs {
  TensorView probs;         // [T, E] f32 | logits dtype: the weights at the chosen experts, 0 else
  TensorView routing_map;   // [T, E] bool: 1 at the chosen experts
  TensorView topk_indices;  // [T, k] i32: chosen experts, by descending weight (ties: lower index)
  TensorView topk_weights;  // [T, k] f32 | logits dtype: their weights, in the same order
};

// Chooses k experts per token and weights them.
//   logits  [T, E] f32 | bf16
// Per token x: softmax post: top-k of x, w = softmax(x[chosen]). softmax pre: s = softmax(x),
// top-k of s, w = s[chosen]. sigmoid / sqrtsoftplus: s = act(x), top-k of s + bias,
// w = s[chosen], then w /= sum(w) + 1e-20 when k > 1. Finally w *= scaling_factor. Ties between
// equal selection scores go to the lower expert index (as jax.lax.top_k).
//
// NaN logits, the same in every implementation and in moekit.jax.route: a NaN selection score
// ranks below every number, -inf included (NaNs among themselves by index; a group whose score
// sums a NaN likewise), so a row chooses its numbers first; the weights follow the formulas and
// are NaN wherever they take a NaN (softmax pre: the whole row; softmax post and k > 1
// normalisation: the row's weights when a NaN was chosen); the output order puts NaN weights last.
//
// Difference from top_k-based implementations: topk_indices are ordered by the final weight, not
// by the selection score; they differ only when an expert bias reorders the choice.
Status route(ConstTensorView logits, const RouteOptions& options, const RouteOutputs& out,
             const Exec& exec = {});

// Gradient of route's weights with respect to the logits.
//   logits          [T, E] f32 | bf16, as given to route
//   topk_indices    [T, k] i32, as route returned them (only this is saved from the forward)
//   d_probs         [T, E] f32 | bf16, or absent: cotangent of probs (read at chosen experts)
//   d_topk_weights  [T, k] f32 | bf16, or absent: cotangent of topk_weights
//   d_logits        [T, E] f32 | logits dtype (overwritten)
// Only the chosen experts receive gradient, except with pre_softmax, where all E do (through
// the softmax). The group choice and the bias are not differentiated.
Status route_backward(ConstTensorView logits, ConstTensorView topk_indices, ConstTensorView d_probs,
                      ConstTensorView d_topk_weights, const RouteOptions& options,
                      TensorView d_logits, const Exec& exec = {});

// Scores for the auxiliary loss: dense, always normalised over all E. softmax: softmax(x);
// sigmoid / sqrtsoftplus: s / (sum(s) + 1e-20) with s = act(x). Plus their own routing map: the
// top-k of these scores (no groups, no bias).
//   logits       [T, E] f32 | bf16
//   scores       [T, E] f32, or absent
//   routing_map  [T, E] bool, or absent
Status aux_loss_scores(ConstTensorView logits, int32_t k, RouterScore score, TensorView scores,
                       TensorView routing_map, RouterImpl impl = RouterImpl::kAuto,
                       const Exec& exec = {});

// Gradient of aux_loss_scores: every one of the E logits receives gradient.
//   logits    [T, E] f32 | bf16
//   d_scores  [T, E] f32 | bf16
//   d_logits  [T, E] f32 | logits dtype
Status aux_loss_scores_backward(ConstTensorView logits, ConstTensorView d_scores, RouterScore score,
                                TensorView d_logits, RouterImpl impl = RouterImpl::kAuto,
                                const Exec& exec = {});

// Column sums of a routing map: how many tokens chose each expert.
//   routing_map  [T, E] bool
//   counts       [E] i32, or [B, E] i32: per sequence, token t in sequence t / (T / B)
//                (tokens batch-major; T must be a multiple of B)
Status count_tokens_per_expert(ConstTensorView routing_map, TensorView counts,
                               const Exec& exec = {});

struct LoadBalancingOptions {
  int32_t k = 1;             // experts per token
  float coeff = 1.0f;        // loss coefficient
  int64_t total_tokens = 0;  // T_total: tokens of the whole batch (>= the local T); 0: the local T
};

// Switch / GShard load-balancing loss:
//   loss = E * coeff / (k * T_total^2) * sum_e (sum_t scores[t, e]) * tokens_per_expert[e]
//   scores             [T, E] f32 | bf16 (from aux_loss_scores)
//   tokens_per_expert  [E] i32 (counts of the whole batch; no gradient)
//   loss               one f32, written (device memory on CUDA)
Status load_balancing_loss(ConstTensorView scores, ConstTensorView tokens_per_expert,
                           const LoadBalancingOptions& options, float* loss, const Exec& exec = {});
// d_scores[t, e] = E * coeff / (k * T_total^2) * tokens_per_expert[e] * d_loss
//   d_scores  [T, E] f32 | bf16
Status load_balancing_loss_backward(ConstTensorView tokens_per_expert,
                                    const LoadBalancingOptions& options, float d_loss,
                                    TensorView d_scores, const Exec& exec = {});

// Sequence-level variant: the same loss per sequence, T_total = S = T / B, averaged over the B
// sequences. options.total_tokens must be 0 (each sequence is its own batch).
//   scores             [T, E] f32 | bf16, tokens batch-major (sequence b holds rows b*S ..)
//   tokens_per_expert  [B, E] i32, counts per sequence
Status seq_load_balancing_loss(ConstTensorView scores, ConstTensorView tokens_per_expert,
                               const LoadBalancingOptions& options, float* loss,
                               const Exec& exec = {});
Status seq_load_balancing_loss_backward(ConstTensorView tokens_per_expert,
                                        const LoadBalancingOptions& options, float d_loss,
                                        TensorView d_scores, const Exec& exec = {});

// z-loss: coeff * mean_t(logsumexp(logits[t])^2); 0 when T = 0.
//   logits  [T, E] f32 | bf16
//   loss    one f32, written (device memory on CUDA)
Status z_loss(ConstTensorView logits, float coeff, float* loss, const Exec& exec = {});
// d_logits[t] = coeff * 2 * logsumexp(logits[t]) * softmax(logits[t]) / T * d_loss
//   d_logits  [T, E] f32 | logits dtype
Status z_loss_backward(ConstTensorView logits, float coeff, float d_loss, TensorView d_logits,
                       const Exec& exec = {});

// Loss-free balancing (DeepSeek-V3): bias[e] += rate * sign(mean(tokens_per_expert) -
// tokens_per_expert[e]); sign(0) = 0.
//   tokens_per_expert  [E] i32
//   expert_bias        [E] f32, updated in place
Status update_expert_bias(ConstTensorView tokens_per_expert, float rate, TensorView expert_bias,
                          const Exec& exec = {});

// Bytes of workspace (Exec::workspace) any router call on `device` with at most `tokens` rows of
// `experts` logits needs: on CUDA the losses' partial sums (the other calls need none); 0 on the
// CPU, and for T = 0.
size_t router_workspace_size(Device device, int64_t tokens, int64_t experts);

}  // namespace moekit
