// Internal: the CPU kernels that solve the router problems (router_problem.h), one file per role
// in this directory:
//   reference.cpp     the scalar reference of every router op, read against SPEC.md section 2
//   route.cpp         the fast route, its backward and the aux-loss scores: rows over threads
//   token_blocks.cpp  the route forward for 16 tokens at a time, the tokens in the vector lanes
//   row_ops.cpp       vector ops over one row: score maps and sums, top-k, output rows
//   scores-inl.h      the score functions on one vector, shared by row_ops and token_blocks
//   losses.cpp        the load-balancing and z losses
// The problems themselves are router_problem.h's, shared with the CUDA implementation.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "cpu/stream.h"
#include "moekit/router.h"
#include "router_problem.h"

namespace moekit::detail {

// Whether a row of n logits holds a NaN: such rows follow router.h's NaN rule and the formulas
// (NaN scores, weights, losses and gradients where they take one), which the vector kernels'
// max, exp and activations do not keep, so every vectorised path checks for them first.
inline bool row_has_nan(const float* x, int64_t n) {
  bool has_nan = false;
  for (int64_t e = 0; e < n; ++e) has_nan |= std::isnan(x[e]);
  return has_nan;
}

Status route_ref(const RouteProblem& p);
// One row of route_ref: logits [E] (f32) to the k experts and their weights, in output order
// (descending weight, NaN last, ties to the lower index). The rule every implementation follows,
// NaN included; route_vectorized takes it for rows holding a NaN.
void route_row_ref(const RouteOptions& o, const float* logits, int64_t E, int32_t* experts,
                   float* weights);
Status route_backward_ref(const RouteBackwardProblem& p);
// One row of route_backward_ref where only the chosen logits get gradient (every score but
// softmax pre): g [k], the chosen weights' cotangents (scaled), and xc [k], their logits, to dxc
// [k]. NaN wherever the formulas take one; route_backward_vectorized takes it for rows whose
// chosen logits hold a NaN.
void route_backward_chosen_row_ref(const RouteOptions& o, const float* g, const float* xc,
                                   float* dxc);
Status aux_scores_ref(const AuxScoresProblem& p);
Status aux_scores_backward_ref(const AuxScoresBackwardProblem& p);

Status route_vectorized(const RouteProblem& p);
Status route_backward_vectorized(const RouteBackwardProblem& p);
Status aux_scores_vectorized(const AuxScoresProblem& p);
Status aux_scores_backward_vectorized(const AuxScoresBackwardProblem& p);

// The forward with the tokens in the vector lanes (token_blocks.cpp), for k <= kLaneMaxK and
// E <= kLaneMaxExperts: chooses and weighs rows [t0, t0 + rows) of p, rows <= kLaneRows, into
// chosen[r * k + i] and weights[r * k + i] (row t0 + r, in the output order: descending weight,
// ties to the lower expert; scaled). Returns the rows it left undecided, bit r for row t0 + r:
// rows with a non-finite key, and rows whose k-th and (k+1)-th keys are too close for its packed
// compare; the caller routes those with the row kernels. zero_bias: E zeros, the bias of options
// without one. work: route_lanes_work_floats floats.
// While it computes it streams what `queue` holds, a few lines at a time, and returns it empty.
inline constexpr int32_t kLaneRows = 16;
inline constexpr int32_t kLaneMaxK = 16;
inline constexpr int64_t kLaneMaxExperts = 4096;
bool route_lanes_apply(const RouteOptions& o, int64_t E);
int64_t route_lanes_work_floats(int64_t E, int32_t num_groups, int32_t k);
uint32_t route_lanes(const RouteProblem& p, int64_t t0, int32_t rows, const float* zero_bias,
                     float* work, int32_t* chosen, float* weights, StreamQueue& queue);

// The backward for every score but pre-softmax, whose gradient reaches only the chosen logits,
// for kLaneRows rows with the rows in the vector lanes (token_blocks.cpp). All three arrays are
// slot-major, [k, kLaneRows], slot i of row r at i * kLaneRows + r: from g, the cotangent of each
// chosen weight times the scaling factor, and xc, the logit it was chosen by, dxc, that logit's
// gradient. Rows past the caller's last are computed too (from whatever g and xc hold there).
void route_backward_chosen(const RouteOptions& o, const float* g, const float* xc, float* dxc);

// The losses, the counts and the bias update on the CPU (losses.cpp), one implementation each:
// threaded row loops on the vector math below, per-row results summed in double.
Status balance_loss_cpu(const BalanceLossProblem& p);
Status balance_loss_backward_cpu(const BalanceBackwardProblem& p);
Status z_loss_cpu(const ZLossProblem& p);
Status z_loss_backward_cpu(const ZLossBackwardProblem& p);
Status count_tokens_cpu(const CountProblem& p);
Status update_expert_bias_cpu(const BiasUpdateProblem& p);

// Vector math over one row of n floats (row_ops.cpp, Highway, dispatched to the widest
// instruction set the CPU has). `out` may alias `x`.
float row_max(const float* x, int64_t n);
float row_dot(const float* a, const float* b, int64_t n);
// out = exp(x - shift); returns sum(out).
float row_exp_shifted(const float* x, float shift, float* out, int64_t n);
// out = sigmoid(x); returns sum(out).
float row_sigmoid(const float* x, float* out, int64_t n);
// out = sqrt(softplus(x)); returns sum(out).
float row_sqrt_softplus(const float* x, float* out, int64_t n);
// The top k of x[0, n) into out[0, k), best first, ties to the lower position: the positions of
// every element >= a lower bound of the k-th largest (the k-th largest of the maxima of disjoint
// slices) are ranked against each other without branches. Scratch:
// candidates room for n, values room for n + 64, out room for k + 1. Returns false, having
// chosen nothing, when x holds NaN; the caller then takes a scalar path.
bool row_top_k(const float* x, int64_t n, int32_t k, int32_t* candidates, float* values,
               int32_t* out);
// out[g] = the sum of the `count` largest values of x[g * per_group, (g + 1) * per_group), added
// largest first, for each of `groups` groups, 1 <= count <= per_group. One pass over x when
// count <= 2 and per_group is a multiple of the vector width; otherwise the cost grows with count
// (meant for the few-per-group sums of group-limited routing). work has room for per_group + 64.
void group_top_sums(const float* x, int64_t groups, int64_t per_group, int32_t count, float* work,
                    float* out);

// Output rows built together in scratch, at[r * count + i] in [0, n):
//   build_sparse_rows: `rows` rows of dtype t (f32 | bf16), 0 with the value of row r, slot i
//                      (values[r * row_step + i * slot_step]) at at[r * count + i]; with `sum`,
//                      repeats within a row add up, else the indices of a row must be distinct.
//                      Returns the first row, the others *stride_bytes apart. work: room for
//                      rows * (n + kRowWorkPad) floats.
//   build_map_rows:    the same for a routing map: bool rows, 0 with 1 at at[r * count + i].
inline constexpr int64_t kRowWorkPad = 128;
char* build_sparse_rows(DType t, bool sum, int64_t n, int64_t rows, const int32_t* at,
                        const float* values, int64_t row_step, int64_t slot_step, int32_t count,
                        float* work, size_t* stride_bytes);
char* build_map_rows(int64_t n, int64_t rows, const int32_t* at, int32_t count, float* work,
                     size_t* stride_bytes);

}  // namespace moekit::detail
