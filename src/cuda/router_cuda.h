// Internal: the CUDA implementation of the router problems (router_problem.h), in
// cuda/router.cu. Included by router.cpp (host compiler; its tables list them): no CUDA header.
//
// One warp per token row holds the row's E logits in registers (E <= kMaxExperts, lane l holding
// experts l, l + 32, ...), so a row is read once, coalesced, and every choice is a warp-wide
// selection with router.h's ranking (NaN last, ties to the lower index). The losses reduce per
// block into the workspace, then one block sums the partials in a fixed order: the same call
// gives the same bits every time.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moekit/status.h"
#include "router_problem.h"

namespace moekit::detail::cuda {

Status route_cuda(const RouteProblem& p);
Status route_backward_cuda(const RouteBackwardProblem& p);
Status aux_scores_cuda(const AuxScoresProblem& p);
Status aux_scores_backward_cuda(const AuxScoresBackwardProblem& p);
Status balance_loss_cuda(const BalanceLossProblem& p);
Status balance_loss_backward_cuda(const BalanceBackwardProblem& p);
Status z_loss_cuda(const ZLossProblem& p);
Status z_loss_backward_cuda(const ZLossBackwardProblem& p);
Status count_tokens_cuda(const CountProblem& p);
Status update_expert_bias_cuda(const BiasUpdateProblem& p);

// Workspace bytes of the losses for any T >= 1 (their per-block partial sums).
size_t router_workspace_bytes(int64_t tokens);

}  // namespace moekit::detail::cuda
