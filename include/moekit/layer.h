// The MoE layer (SPEC.md section 5), forward and backward, built from the public steps:
//
//   logits = x @ router                                   [T, E] f32      (router GEMM)
//   route(logits) -> topk_indices, topk_weights           [T, k]          (router.h)
//   x_perm = permute(x, topk_indices)                     [N, H]          (permute.h)
//   h      = ragged_dot(x_perm, w_in, tokens_per_expert)  [N, 2F] or [N, F]   (gmm_up)
//            (+ b_in[e] on the rows of expert e, with expert biases)
//   a      = activation(h)                                [N, F]          (activation.h)
//   y      = ragged_dot(a, w_out, tokens_per_expert)      [N, H]          (gmm_down)
//            (+ b_out[e])
//   out    = unpermute(y, row_map, topk_weights)          [T, H]          (combine)
//          + activation(x @ shared_in) @ shared_out, with a shared expert
//   aux_loss, z_loss: the router's losses (router.h), beside the output
//
// Each step is a public call of its own (route, permute, ragged_dot, activation, unpermute), so
// a caller who needs communication between two of them (an all-to-all after permute) composes
// them; this file adds the whole layer, on one device or over P ranks (activation.h has the
// activation).
//
// Notation: T tokens, H hidden size, E experts, k experts per token, F expert FFN width, Fs the
// shared expert's width, N rows of the permuted buffer (T * k dropless; permute_max_rows with a
// capacity or an alignment). x, every weight and every activation share one dtype, f32 or bf16;
// the router logits and the losses are f32 and every sum runs in f32.
//
// Memory: the caller owns it all. moe_layer_workspace() says how many bytes the layer needs for
// its saved activations (written by the forward, read by the backward) and for each pass's
// scratch; nothing is allocated inside. Saved, in this order, each 64-byte aligned:
//   logits [T, E] f32, topk_indices [T, k] i32, topk_weights [T, k] f32,
//   tokens_per_expert [E] i32, row_map [2, T, k] i32, aux-loss counts [B, E] i32 (B = 1, or the
//   sequences of the sequence-level loss), x_perm [N, H], h [N, 2F | F], a [N, F], y [N, H],
//   and with a shared expert hs [T, 2Fs | Fs], as [T, Fs].
// Every call validates all of its arguments, with errors naming the argument and its value,
// before it writes anything.
//
// On one rank the layer runs where its Exec says (moekit/exec.h): the CPU, or the current CUDA
// device, where every tensor, the saved and scratch buffers (256-byte aligned there, sized by
// moe_layer_workspace with Device::kCuda: they hold the ops' workspace too), the losses and
// tokens_per_expert are device memory, config.route.expert_bias too. A CUDA pass is queued on the
// stream and waits for nothing (the group sizes stay on the device; it can be captured in a CUDA
// graph), except with a profile, whose per-step times wait for the stream around each step. The
// router and shared-expert matmuls run on cuBLAS, the grouped ones on ragged_dot's kernels. Not
// on CUDA: batch_invariant, more than 1024 experts, and the layer over P ranks (CPU ranks).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "moekit/activation.h"
#include "moekit/ep.h"
#include "moekit/permute.h"
#include "moekit/router.h"
#include "moekit/status.h"
#include "moekit/view.h"

namespace moekit {

struct MoeLayerConfig {
  int64_t hidden = 0;       // H
  int64_t ffn = 0;          // F, per expert
  int64_t num_experts = 0;  // E
  RouteOptions route;       // k, score, group-limited routing, scaling, expert bias
  Activation activation = Activation::kSwiGLU;
  // The shared expert's FFN width (DeepSeek: shared experts * F); 0: no shared expert. It uses
  // the same activation.
  int64_t shared_ffn = 0;

  // Capacity (token dropping) as in permute.h: 0 = dropless (the default).
  double capacity_factor = 0.0;
  DropPolicy drop_policy = DropPolicy::kProbs;
  bool pad_to_capacity = false;
  int64_t align_size = 1;  // each expert's rows padded to a multiple of this

  // Load-balancing loss coefficient (Switch / GShard form, on the aux-loss scores of router.h,
  // counted over this call's T tokens); 0: not computed (reported as 0).
  float aux_loss_coeff = 0.0f;
  // > 0: the sequence-level loss instead, over this many sequences of T / B tokens each.
  int32_t aux_loss_sequences = 0;
  float z_loss_coeff = 0.0f;  // 0: not computed

  // How the experts' weights w_in and w_out lie (their gradients likewise). false (the
  // default): [E, H, 2F | F] and [E, F, H], each expert's matrix [in, out] (h = x @ w_in[e]).
  // true: [E, 2F | F, H] and [E, H, F], each a linear layer's [out, in] (h = x @ w_in[e]^T), as
  // PyTorch and Hugging Face checkpoints store them: read as they lie
  // (RaggedDotOptions::rhs_transposed), no copy. The layouts stream differently: on a Xeon with
  // AMX the forward ran 1.5-1.7x faster on [out, in] (mixtral-8x7b, 32-256 tokens) and 1.3-1.4x
  // (qwen3-30b-a3b, 64-256), the backward 0-17% slower (bench/results/
  // layer_weight_layout-cpu-2026-11-28). The router and the shared expert keep their layouts.
  bool expert_weights_transposed = false;
  // The experts' weights packed once for inference (pack_ragged_rhs, RaggedDotOptions::rhs_packed:
  // each 32-column panel's whole contraction front to back): w_in packed from [E, H, 2F | F] (or
  // its transpose), in bf16 [E, ceil(2F | F / 32), 64 * ceil(H / 2)], in f32 [E, ceil(2F | F /
  // 32), 32 * H]; w_out from [E, F, H], packed_rhs_shape(E, F, H, dtype) likewise (over P ranks
  // each rank's E_loc experts, packed_rhs_shape(E_loc, ...)). The forward only, bf16 or f32, on
  // the CPU, on one rank or P: the backwards refuse it, and expert_weights_transposed
  // must be false (the packed form is the same from either layout). On weight rows too long for a
  // block of them and the rows' sums to stay in a core's caches (mixtral-8x7b's, gpt-oss-20b's) the
  // grouped matmuls at 4-16 rows an expert ran 1.3-1.6x faster on them
  // (bench/results/ragged_dot_small-cpu-2026-11-29-5).
  bool expert_weights_packed = false;

  // Batch invariance (RaggedDotOptions::batch_invariant in every matmul; the router, permute,
  // the activation and unpermute work token by token already): a token's output, and its d_x,
  // are the same bits whatever the other tokens of the call, the number of threads, and over P
  // ranks the number of ranks. Not where the result depends on the batch by definition: the
  // tokens a capacity drops, and d_x with a load-balancing loss or a z-loss (their gradients
  // depend on every token's routing, and on T). Off by default: see bench/results for its cost.
  bool batch_invariant = false;
};

// Weights, all in x's dtype. Gated activations fuse gate and up in w_in.
struct MoeLayerWeights {
  ConstTensorView router;  // [H, E]
  ConstTensorView w_in;    // [E, H, 2F] gated (gate | up), [E, H, F] otherwise
  ConstTensorView w_out;   // [E, F, H]
  // (with config.expert_weights_transposed: w_in [E, 2F | F, H], w_out [E, H, F]; with
  // config.expert_weights_packed, packed: see there)
  ConstTensorView shared_in;   // [H, 2Fs] | [H, Fs], present when shared_ffn > 0
  ConstTensorView shared_out;  // [Fs, H]
  // Optional biases of the expert FFNs (MaxText's w0 / w1 / wo biases, gpt-oss's), each present
  // or absent on its own: h = x_perm @ w_in[e] + b_in[e] and y = a @ w_out[e] + b_out[e] for
  // the rows of expert e. The matmul's result is rounded to x's dtype, the bias added in f32
  // and the sum rounded again (as a framework adds a bias to a matmul's output). Padding rows
  // of an alignment or a capacity get the bias too; unpermute never reads them.
  ConstTensorView b_in;   // [E, 2F] | [E, F]
  ConstTensorView b_out;  // [E, H]
};

// Weight gradients, shaped as the weights, f32 or x's dtype. Absent shared ones are allowed
// only without a shared expert; b_in and b_out are present exactly where the weights have them
// (d b_in[e]: the sum of the rows of expert e of d_h, in f32; d b_out[e]: of d_y).
struct MoeLayerWeightGrads {
  TensorView router, w_in, w_out, shared_in, shared_out, b_in, b_out;
};

struct MoeLayerOutputs {
  TensorView out;  // [T, H] x's dtype
  // Each or null: the load-balancing loss and the z-loss (0 when its coeff is 0), in the call's
  // memory (device memory on CUDA).
  float* aux_loss = nullptr;
  float* z_loss = nullptr;
  TensorView tokens_per_expert;  // [E] i32, or absent: rows per expert, as permute made them
};

struct MoeLayerWorkspace {
  size_t saved_bytes = 0;     // the forward writes, the backward reads
  size_t forward_bytes = 0;   // the forward's scratch
  size_t backward_bytes = 0;  // the backward's scratch
};

// The bytes the layer needs for T tokens in dtype `dtype` on `device` (on CUDA, for the current
// device). All zero when the config is invalid (the layer calls name the problem).
MoeLayerWorkspace moe_layer_workspace(const MoeLayerConfig& config, int64_t tokens, DType dtype,
                                      Device device = Device::kCpu);

// Rows of the permuted buffer (N above) for T tokens; -1 when the config is invalid.
int64_t moe_layer_rows(const MoeLayerConfig& config, int64_t tokens);

// The steps of the layer, in forward order, for per-step timings.
enum class MoeStep {
  kRouterGemm,
  kRoute,  // forward: route and the losses; backward: their gradients to the logits
  kPermute,
  kGmmUp,
  kActivation,
  kGmmDown,
  kUnpermute,
  kSharedExpert,
  kDispatch,  // over P ranks: the plan and the exchange of rows to the experts' ranks
  kCombine,   // over P ranks: the exchange back
};
inline constexpr int kMoeSteps = 10;
const char* moe_step_name(MoeStep s);  // "router_gemm", "route", ...

// Milliseconds per step of the last call that was given this profile (wall clock). Steps a call
// does not take (the shared expert without one; dispatch and combine on one rank) stay 0.
struct MoeLayerProfile {
  std::array<double, kMoeSteps> ms{};
};

// Forward.
//   x      [T, H] f32 | bf16
//   saved  at least saved_bytes, 64-byte aligned (256 on CUDA): written here, read by the
//          backward
//   scratch at least forward_bytes, aligned likewise
// Inference needs saved too (it holds the intermediates); its contents may then be dropped.
Status moe_layer_forward(ConstTensorView x, const MoeLayerWeights& weights,
                         const MoeLayerConfig& config, std::span<std::byte> saved,
                         std::span<std::byte> scratch, const MoeLayerOutputs& out,
                         MoeLayerProfile* profile = nullptr, const Exec& exec = {});

// Backward, from the saved activations of a forward with the same x, weights and config.
//   d_out         [T, H] x's dtype: the output's cotangent
//   d_aux_loss, d_z_loss: the losses' cotangents
//   scratch       at least backward_bytes, 64-byte aligned (256 on CUDA)
//   d_x           [T, H] f32 | x's dtype
//   grads         the weight gradients (overwritten)
Status moe_layer_backward(ConstTensorView x, const MoeLayerWeights& weights,
                          const MoeLayerConfig& config, std::span<const std::byte> saved,
                          ConstTensorView d_out, float d_aux_loss, float d_z_loss,
                          std::span<std::byte> scratch, TensorView d_x,
                          const MoeLayerWeightGrads& grads, MoeLayerProfile* profile = nullptr,
                          const Exec& exec = {});

// ---------------------------------------------------------------------------------------------
// The layer over P ranks (SPEC.md section 4): every rank its own T_p tokens (any number, 0
// included) and E_loc = E / P experts, rank p holding experts p*E_loc .. (p+1)*E_loc - 1.
//
//   forward:  router GEMM, route, losses, permute       (this rank's tokens, all E experts)
//             ep_plan, ep_dispatch                      (rows to the ranks holding their experts)
//             gmm_up, activation, gmm_down              (the rows of this rank's experts)
//             ep_combine, unpermute, shared expert      (back to this rank's tokens)
//   backward: the same in reverse, dispatch and combine swapped.
//
// Both calls are collective over `comm` (each rank calls them, in the same order) and agree
// across ranks before anything moves: a bad argument on any rank, or ranks whose configs or
// dtypes differ, is an error on every rank, and no rank waits for ever.
//
// Weights: router, shared_in and shared_out are the same on every rank (replicated); w_in
// [E_loc, H, 2F | F] and w_out [E_loc, F, H] hold this rank's experts, as do the biases b_in
// [E_loc, 2F | F] and b_out [E_loc, H] where given. Gradients: each rank's
// w_in and w_out gradients are its experts' own; the replicated weights' gradients are summed
// over the ranks inside the backward (in f32, then rounded once to the gradients' dtype), so
// every rank returns the same, complete gradient.
//
// Losses: the load-balancing loss uses the counts and the token count of the whole group, and
// the z-loss is the mean over every token of the group, so both equal the one-rank layer's on
// the concatenated tokens; every rank returns the same value, and each rank's backward takes the
// same cotangent (the loss is counted once, not once per rank). The sequence-level loss averages
// over the P * aux_loss_sequences sequences of the group (each rank's own B sequences).
// out.tokens_per_expert, when given, receives the rows per expert over the whole group.
//
// Capacity: each rank drops its own tokens in permute, before anything moves (a per-sender
// capacity of ceil(T_p * k / E * capacity_factor)); dropless (the default) sizes everything
// exactly from the step's plan.
//
// Equivalence (SPEC.md section 4): dropless, each expert sees the rows of the one-rank layer on
// the concatenated tokens, in the same order.
//
// Memory: the state holds the step's plan and every buffer the layer needs, grown as a step
// needs more (the rows a rank receives change from step to step) and never shrunk; nothing else
// is allocated. Keep one state per layer and reuse it: after the largest step, a step allocates
// nothing.
class MoeLayerEpState {
 public:
  MoeLayerEpState();
  ~MoeLayerEpState();
  MoeLayerEpState(MoeLayerEpState&&) noexcept;
  MoeLayerEpState& operator=(MoeLayerEpState&&) noexcept;

  const EpPlan& plan() const;  // the last forward's
  size_t bytes() const;        // the memory held

  struct Impl;
  std::unique_ptr<Impl> impl;
};

// Forward on this rank's tokens.
//   x        [T_p, H] f32 | bf16
//   weights  router [H, E], w_in [E_loc, H, 2F | F], w_out [E_loc, F, H], shared as on one rank;
//            w_in and w_out packed with config.expert_weights_packed (this rank's E_loc experts)
//   out      as on one rank; tokens_per_expert [E] gets the group's counts
Status moe_layer_ep_forward(ConstTensorView x, const MoeLayerWeights& weights,
                            const MoeLayerConfig& config, Communicator& comm,
                            MoeLayerEpState* state, const MoeLayerOutputs& out,
                            MoeLayerProfile* profile = nullptr);

// Backward, from the state of a forward with the same x, weights, config and group.
//   d_out  [T_p, H] x's dtype; d_aux_loss, d_z_loss: the losses' cotangents (the same on every
//          rank)
//   d_x    [T_p, H] f32 | x's dtype
//   grads  router [H, E] and shared: summed over the ranks; w_in, w_out: this rank's experts
Status moe_layer_ep_backward(ConstTensorView x, const MoeLayerWeights& weights,
                             const MoeLayerConfig& config, Communicator& comm,
                             MoeLayerEpState* state, ConstTensorView d_out, float d_aux_loss,
                             float d_z_loss, TensorView d_x, const MoeLayerWeightGrads& grads,
                             MoeLayerProfile* profile = nullptr);

}  // namespace moekit
