// The MoE layer on one device: the public steps (router GEMM, route, permute, gmm_up, activation,
// gmm_down, unpermute, shared expert, losses) called in order on buffers carved from the caller's
// workspace. Every argument is validated before the first step runs; the router and
// permutation options are validated by an empty call of their own op, so that the rules live in
// one place.
#include "moekit/layer.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "check.h"
#include "cpu/convert.h"
#include "moekit/ragged_dot.h"

namespace moekit {
namespace {

using detail::check_dim;
using detail::check_input_dtype;
using detail::check_output_dtype;
using detail::check_same_dtype;
using detail::check_view;
using detail::present;
using detail::shape_str;

constexpr size_t kAlign = 64;

// The sizes of one layer call.
struct Dims {
  int64_t T, H, F, E, k, N;
  int64_t W;       // gmm_up's output width: 2F gated, F otherwise
  int64_t Fs, Ws;  // the shared expert's width and its up width (0: none)
  int64_t B;       // rows of the aux-loss counts: the sequences, or 1
  DType dt;        // x, weights and activations
};

// Carves 64-byte aligned tensors out of one buffer, in order; with a null base it only counts
// the bytes.
class Arena {
 public:
  explicit Arena(std::byte* base) : base_(base) {}
  TensorView take(DType t, std::initializer_list<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    void* p = base_ ? base_ + used_ : nullptr;
    used_ += (static_cast<size_t>(n) * dtype_size(t) + kAlign - 1) / kAlign * kAlign;
    return TensorView(p, t, shape);
  }
  size_t used() const { return used_; }

 private:
  std::byte* base_;
  size_t used_ = 0;
};

// What the forward saves for the backward (the order include/moekit/layer.h states).
struct Saved {
  TensorView logits, topk_indices, topk_weights, tokens_per_expert, row_map, counts;
  TensorView x_perm, h, a, y, hs, as;
};
Saved carve_saved(const Dims& d, Arena& m) {
  Saved s;
  s.logits = m.take(DType::kF32, {d.T, d.E});
  s.topk_indices = m.take(DType::kI32, {d.T, d.k});
  s.topk_weights = m.take(DType::kF32, {d.T, d.k});
  s.tokens_per_expert = m.take(DType::kI32, {d.E});
  s.row_map = m.take(DType::kI32, {2, d.T, d.k});
  s.counts = m.take(DType::kI32, {d.B, d.E});
  s.x_perm = m.take(d.dt, {d.N, d.H});
  s.h = m.take(d.dt, {d.N, d.W});
  s.a = m.take(d.dt, {d.N, d.F});
  s.y = m.take(d.dt, {d.N, d.H});
  if (d.Fs > 0) {
    s.hs = m.take(d.dt, {d.T, d.Ws});
    s.as = m.take(d.dt, {d.T, d.Fs});
  }
  return s;
}

// The forward's scratch: the aux-loss scores and their routing map.
// With a shared expert and bf16 x, out_f32 [T, H] sums the routed experts' and the shared
// expert's outputs in f32, rounded once into out, as d_x in the backward. (In a standalone check
// the shared expert's accumulating down projection into bf16 was about 10% slower than into f32.)
struct ForwardScratch {
  TensorView scores, aux_map, out_f32;
};
ForwardScratch carve_forward(const Dims& d, Arena& m) {
  ForwardScratch s{m.take(DType::kF32, {d.T, d.E}), m.take(DType::kBool, {d.T, d.E}), {}};
  if (d.Fs > 0 && d.dt != DType::kF32) s.out_f32 = m.take(DType::kF32, {d.T, d.H});
  return s;
}

// The backward's scratch. d_y also serves as d_x_perm (d_y is dead by then).
struct BackwardScratch {
  TensorView d_y, d_a, d_h, d_topk_weights, d_logits, d_tmp, d_tmp2, d_logits_dt, d_as, d_hs;
  // [T, H] f32 with bf16 x: d_x's three terms summed in f32 and rounded once. oneDNN's matmul
  // for the router's input gradient (K = E) runs several times slower into bf16 than into f32
  // (standalone check at qwen3-30b-a3b's router shape, 4096 tokens: 15 against 3-4 ms).
  TensorView d_x_f32;
};
BackwardScratch carve_backward(const Dims& d, Arena& m) {
  BackwardScratch s;
  s.d_y = m.take(d.dt, {d.N, d.H});
  s.d_a = m.take(d.dt, {d.N, d.F});
  s.d_h = m.take(d.dt, {d.N, d.W});
  s.d_topk_weights = m.take(DType::kF32, {d.T, d.k});
  s.d_logits = m.take(DType::kF32, {d.T, d.E});
  s.d_tmp = m.take(DType::kF32, {d.T, d.E});
  s.d_tmp2 = m.take(DType::kF32, {d.T, d.E});
  // The logits' gradient in x's dtype for the router GEMM's backward (f32: d_logits itself).
  s.d_logits_dt = d.dt == DType::kF32 ? s.d_logits : m.take(d.dt, {d.T, d.E});
  if (d.Fs > 0) {
    s.d_as = m.take(d.dt, {d.T, d.Fs});
    s.d_hs = m.take(d.dt, {d.T, d.Ws});
  }
  if (d.dt != DType::kF32) s.d_x_f32 = m.take(DType::kF32, {d.T, d.H});
  return s;
}

// The bytes each buffer needs: the arenas run with no base and only count.
MoeLayerWorkspace workspace_of(const Dims& d) {
  Arena saved(nullptr), fwd(nullptr), bwd(nullptr);
  carve_saved(d, saved);
  carve_forward(d, fwd);
  carve_backward(d, bwd);
  return {saved.used(), fwd.used(), bwd.used()};
}

PermuteOptions permute_options(const MoeLayerConfig& c) {
  PermuteOptions o;
  o.align_size = c.align_size;
  o.capacity_factor = c.capacity_factor;
  o.drop_policy = c.drop_policy;
  o.pad_to_capacity = c.pad_to_capacity;
  return o;
}

// The config on its own; fills d (dt unset).
Status check_config(const char* op, const MoeLayerConfig& c, int64_t T, Dims& d) {
  auto positive = [&](const char* name, int64_t v) -> Status {
    if (v > 0) return {};
    return Status::invalid_argument(op, name, std::to_string(v), "must be > 0");
  };
  MOEKIT_RETURN_IF_ERROR(positive("config.hidden", c.hidden));
  MOEKIT_RETURN_IF_ERROR(positive("config.ffn", c.ffn));
  MOEKIT_RETURN_IF_ERROR(positive("config.num_experts", c.num_experts));
  if (c.shared_ffn < 0) {
    return Status::invalid_argument(op, "config.shared_ffn", std::to_string(c.shared_ffn),
                                    "must be >= 0 (0: no shared expert)");
  }
  const Activation act = c.activation;
  if (act != Activation::kSwiGLU && act != Activation::kGeGLU && act != Activation::kGelu &&
      act != Activation::kRelu) {
    return Status::invalid_argument(op, "config.activation", std::to_string(static_cast<int>(act)),
                                    "not an Activation");
  }
  if (T > std::numeric_limits<int32_t>::max()) {
    return Status::invalid_argument(op, "x.shape[0]", std::to_string(T),
                                    "tokens must fit in int32 (group sizes are int32)");
  }
  for (auto [name, v] : {std::pair{"config.aux_loss_coeff", c.aux_loss_coeff},
                         std::pair{"config.z_loss_coeff", c.z_loss_coeff}}) {
    if (!std::isfinite(v)) {
      return Status::invalid_argument(op, name, fmt::format("{}", v), "must be finite");
    }
  }
  if (c.aux_loss_sequences < 0 || (c.aux_loss_sequences > 0 && T % c.aux_loss_sequences != 0)) {
    return Status::invalid_argument(
        op, "config.aux_loss_sequences", std::to_string(c.aux_loss_sequences),
        fmt::format("must be 0 (batch-level loss) or divide the {} tokens", T));
  }
  // The router's and the permutation's own rules, by an empty call of each.
  {
    const ConstTensorView logits(nullptr, DType::kF32, {0, c.num_experts});
    RouteOutputs none;
    MOEKIT_RETURN_IF_ERROR(route(logits, c.route, none));
  }
  const int64_t N = permute_max_rows(T, c.num_experts, c.route.k, permute_options(c));
  if (N < 0) {
    std::vector<int32_t> counts(static_cast<size_t>(c.num_experts)), rm(0);
    PermuteOutputs out{{},
                       {},
                       TensorView(counts.data(), DType::kI32, {c.num_experts}),
                       TensorView(rm.data(), DType::kI32, {2, 0, c.route.k}),
                       {}};
    MOEKIT_RETURN_IF_ERROR(permute({}, ConstTensorView(nullptr, DType::kI32, {0, c.route.k}), {},
                                   permute_options(c), out));
    return Status::invalid_argument(op, "config", "capacity / alignment",
                                    "the permuted buffer's size overflows");
  }
  const bool gated = is_gated(act);
  d.T = T, d.H = c.hidden, d.F = c.ffn, d.E = c.num_experts, d.k = c.route.k, d.N = N;
  d.W = gated ? 2 * d.F : d.F;
  d.Fs = c.shared_ffn, d.Ws = gated ? 2 * d.Fs : d.Fs;
  d.B = c.aux_loss_sequences > 0 ? c.aux_loss_sequences : 1;
  return {};
}

// A weight [dims...] in x's dtype.
Status check_weight(const char* op, const char* name, const ConstTensorView& w, DType dt,
                    std::initializer_list<int64_t> dims, const char* dims_what) {
  MOEKIT_RETURN_IF_ERROR(check_view(op, name, w, static_cast<int>(dims.size())));
  MOEKIT_RETURN_IF_ERROR(check_same_dtype(op, name, w.dtype, "x", dt));
  int i = 0;
  for (int64_t want : dims) {
    if (w.shape[i++] != want) {
      return Status::invalid_argument(
          op, fmt::format("{}.shape", name), shape_str(w),
          fmt::format("must be {} = {}", dims_what, shape_str(ConstTensorView(nullptr, dt, dims))));
    }
  }
  return {};
}

Status check_weights(const char* op, const MoeLayerWeights& w, const Dims& d) {
  MOEKIT_RETURN_IF_ERROR(check_weight(op, "weights.router", w.router, d.dt, {d.H, d.E}, "[H, E]"));
  MOEKIT_RETURN_IF_ERROR(check_weight(op, "weights.w_in", w.w_in, d.dt, {d.E, d.H, d.W},
                                      d.W == d.F ? "[E, H, F]" : "[E, H, 2F] (gate | up)"));
  MOEKIT_RETURN_IF_ERROR(
      check_weight(op, "weights.w_out", w.w_out, d.dt, {d.E, d.F, d.H}, "[E, F, H]"));
  if (d.Fs == 0) {
    if (present(w.shared_in) || present(w.shared_out)) {
      return Status::invalid_argument(op, "weights.shared_in", shape_str(w.shared_in),
                                      "given, but config.shared_ffn = 0");
    }
    return {};
  }
  MOEKIT_RETURN_IF_ERROR(check_weight(op, "weights.shared_in", w.shared_in, d.dt, {d.H, d.Ws},
                                      d.Ws == d.Fs ? "[H, Fs]" : "[H, 2Fs] (gate | up)"));
  return check_weight(op, "weights.shared_out", w.shared_out, d.dt, {d.Fs, d.H}, "[Fs, H]");
}

// A weight gradient shaped as its weight, f32 or x's dtype.
Status check_grad(const char* op, const char* name, const TensorView& g, const ConstTensorView& w) {
  MOEKIT_RETURN_IF_ERROR(check_view(op, name, g, w.rank));
  MOEKIT_RETURN_IF_ERROR(check_output_dtype(op, name, g.dtype, w.dtype));
  for (int i = 0; i < w.rank; ++i) {
    if (g.shape[i] != w.shape[i]) {
      return Status::invalid_argument(op, fmt::format("{}.shape", name), shape_str(g),
                                      fmt::format("must match the weight's {}", shape_str(w)));
    }
  }
  return {};
}

Status check_workspace(const char* op, const char* name, std::span<const std::byte> s,
                       size_t need) {
  if (s.size() < need) {
    return Status::invalid_argument(op, fmt::format("{}.size()", name), std::to_string(s.size()),
                                    fmt::format("needs {} bytes (moe_layer_workspace)", need));
  }
  if (need > 0 && reinterpret_cast<uintptr_t>(s.data()) % kAlign != 0) {
    return Status::invalid_argument(op, fmt::format("{}.data()", name),
                                    fmt::format("{}", static_cast<const void*>(s.data())),
                                    "must be 64-byte aligned");
  }
  return {};
}

// x, the config and the weights: fills d.
Status check_inputs(const char* op, const ConstTensorView& x, const MoeLayerWeights& w,
                    const MoeLayerConfig& c, Dims& d) {
  MOEKIT_RETURN_IF_ERROR(check_view(op, "x", x, 2));
  MOEKIT_RETURN_IF_ERROR(check_input_dtype(op, "x", x.dtype));
  MOEKIT_RETURN_IF_ERROR(check_config(op, c, x.shape[0], d));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "x", x, 1, c.hidden, "config.hidden"));
  d.dt = x.dtype;
  return check_weights(op, w, d);
}

// A view of the first `rows` rows.
template <class View>
View first_rows(View v, int64_t rows) {
  v.shape[0] = rows;
  return v;
}

// A [rows, cols] matrix as the one group [1, rows, cols] that ragged_dot multiplies by.
template <class View>
View as_group(View g) {
  g.rank = 3;
  g.shape = {1, g.shape[0], g.shape[1], 0};
  g.stride = {g.shape[1] * g.stride[0], g.stride[0], g.stride[1], 0};
  return g;
}

// Runs one step, adding its wall time to the profile when there is one.
template <class Fn>
Status timed(MoeLayerProfile* profile, MoeStep step, Fn fn) {
  if (!profile) return fn();
  const auto t0 = std::chrono::steady_clock::now();
  Status s = fn();
  profile->ms[static_cast<int>(step)] +=
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return s;
}

std::span<const int32_t> group_sizes(const TensorView& tokens_per_expert) {
  return {static_cast<const int32_t*>(tokens_per_expert.data),
          static_cast<size_t>(tokens_per_expert.shape[0])};
}

// The routed rows: the sum of the group sizes.
int64_t used_rows(std::span<const int32_t> sizes) {
  return std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
}

// acc += v, both contiguous f32 of the same shape.
void add_into(const TensorView& acc, const TensorView& v) {
  auto* a = static_cast<float*>(acc.data);
  const auto* b = static_cast<const float*>(v.data);
  const int64_t n = acc.numel();
#pragma omp parallel for simd schedule(static) if (n >= (1 << 16))
  for (int64_t i = 0; i < n; ++i) a[i] += b[i];
}

// The rows of a contiguous f32 [rows, cols] matrix into a (strided) view of any float dtype.
void store_rows(const TensorView& in, const TensorView& out) {
  const int64_t rows = in.shape[0], cols = in.shape[1];
#pragma omp parallel for schedule(static) if (rows * cols >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    detail::store_row_from_float(static_cast<const float*>(in.data) + r * cols, cols,
                                 detail::row_ptr(out, r), out.dtype);
  }
}

LoadBalancingOptions lb_options(const MoeLayerConfig& c) {
  LoadBalancingOptions o;
  o.k = c.route.k;
  o.coeff = c.aux_loss_coeff;
  return o;
}

}  // namespace

const char* moe_step_name(MoeStep s) {
  static constexpr const char* kNames[kMoeSteps] = {
      "router_gemm", "route", "permute", "gmm_up", "activation", "gmm_down", "unpermute", "shared"};
  const int i = static_cast<int>(s);
  return i >= 0 && i < kMoeSteps ? kNames[i] : "?";
}

int64_t moe_layer_rows(const MoeLayerConfig& config, int64_t tokens) {
  Dims d;
  if (tokens < 0 || !check_config("moe_layer_rows", config, tokens, d).ok()) return -1;
  return d.N;
}

MoeLayerWorkspace moe_layer_workspace(const MoeLayerConfig& config, int64_t tokens, DType dtype) {
  Dims d;
  if (tokens < 0 || !check_config("moe_layer_workspace", config, tokens, d).ok()) return {};
  d.dt = dtype;
  return workspace_of(d);
}

Status moe_layer_forward(ConstTensorView x, const MoeLayerWeights& weights,
                         const MoeLayerConfig& config, std::span<std::byte> saved_buf,
                         std::span<std::byte> scratch_buf, const MoeLayerOutputs& out,
                         MoeLayerProfile* profile) {
  constexpr const char* op = "moe_layer_forward";
  Dims d;
  MOEKIT_RETURN_IF_ERROR(check_inputs(op, x, weights, config, d));
  MOEKIT_RETURN_IF_ERROR(check_view(op, "out.out", out.out, 2));
  MOEKIT_RETURN_IF_ERROR(check_same_dtype(op, "out.out", out.out.dtype, "x", d.dt));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "out.out", out.out, 0, d.T, "x.shape[0]"));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "out.out", out.out, 1, d.H, "config.hidden"));
  if (present(out.tokens_per_expert)) {
    MOEKIT_RETURN_IF_ERROR(check_view(op, "out.tokens_per_expert", out.tokens_per_expert, 1));
    MOEKIT_RETURN_IF_ERROR(
        detail::check_dtype(op, "out.tokens_per_expert", out.tokens_per_expert.dtype, DType::kI32));
    MOEKIT_RETURN_IF_ERROR(check_dim(op, "out.tokens_per_expert", out.tokens_per_expert, 0, d.E,
                                     "config.num_experts"));
  }
  const MoeLayerWorkspace need = workspace_of(d);
  MOEKIT_RETURN_IF_ERROR(check_workspace(op, "saved", saved_buf, need.saved_bytes));
  MOEKIT_RETURN_IF_ERROR(check_workspace(op, "scratch", scratch_buf, need.forward_bytes));
  if (profile) *profile = {};

  Arena saved_arena(saved_buf.data()), scratch_arena(scratch_buf.data());
  const Saved s = carve_saved(d, saved_arena);
  const ForwardScratch f = carve_forward(d, scratch_arena);
  const int32_t all_tokens[1] = {static_cast<int32_t>(d.T)};
  const ConstTensorView router = as_group(weights.router);

  // logits [T, E] f32 = x @ router.
  MOEKIT_RETURN_IF_ERROR(timed(profile, MoeStep::kRouterGemm,
                               [&] { return ragged_dot(x, router, all_tokens, s.logits); }));
  float aux_loss = 0.0f, z = 0.0f;
  MOEKIT_RETURN_IF_ERROR(timed(profile, MoeStep::kRoute, [&]() -> Status {
    MOEKIT_RETURN_IF_ERROR(route(s.logits, config.route, {{}, {}, s.topk_indices, s.topk_weights}));
    if (config.aux_loss_coeff != 0.0f) {
      MOEKIT_RETURN_IF_ERROR(
          aux_loss_scores(s.logits, config.route.k, config.route.score, f.scores, f.aux_map));
      const TensorView counts = d.B > 1 ? s.counts : TensorView(s.counts.data, DType::kI32, {d.E});
      MOEKIT_RETURN_IF_ERROR(count_tokens_per_expert(f.aux_map, counts));
      MOEKIT_RETURN_IF_ERROR(
          d.B > 1 ? seq_load_balancing_loss(f.scores, counts, lb_options(config), &aux_loss)
                  : load_balancing_loss(f.scores, counts, lb_options(config), &aux_loss));
    }
    if (config.z_loss_coeff != 0.0f)
      MOEKIT_RETURN_IF_ERROR(z_loss(s.logits, config.z_loss_coeff, &z));
    return {};
  }));
  // x_perm [N, H]: expert-major rows; the capacity's probs policy ranks by the routing weights.
  const bool by_probs = config.capacity_factor > 0.0 && config.drop_policy == DropPolicy::kProbs;
  MOEKIT_RETURN_IF_ERROR(timed(profile, MoeStep::kPermute, [&] {
    return permute(x, s.topk_indices,
                   by_probs ? ConstTensorView(s.topk_weights) : ConstTensorView{},
                   permute_options(config), {s.x_perm, {}, s.tokens_per_expert, s.row_map, {}});
  }));
  const auto sizes = group_sizes(s.tokens_per_expert);
  const int64_t rows = used_rows(sizes);
  MOEKIT_RETURN_IF_ERROR(timed(profile, MoeStep::kGmmUp,
                               [&] { return ragged_dot(s.x_perm, weights.w_in, sizes, s.h); }));
  MOEKIT_RETURN_IF_ERROR(timed(profile, MoeStep::kActivation, [&] {
    return activation(first_rows(s.h, rows), config.activation, first_rows(s.a, rows));
  }));
  MOEKIT_RETURN_IF_ERROR(timed(profile, MoeStep::kGmmDown,
                               [&] { return ragged_dot(s.a, weights.w_out, sizes, s.y); }));
  const TensorView out_acc = f.out_f32.data ? f.out_f32 : out.out;
  MOEKIT_RETURN_IF_ERROR(timed(profile, MoeStep::kUnpermute,
                               [&] { return unpermute(s.y, s.row_map, s.topk_weights, out_acc); }));
  if (d.Fs > 0) {
    MOEKIT_RETURN_IF_ERROR(timed(profile, MoeStep::kSharedExpert, [&]() -> Status {
      MOEKIT_RETURN_IF_ERROR(ragged_dot(x, as_group(weights.shared_in), all_tokens, s.hs));
      MOEKIT_RETURN_IF_ERROR(activation(s.hs, config.activation, s.as));
      RaggedDotOptions add;
      add.accumulate = true;
      MOEKIT_RETURN_IF_ERROR(
          ragged_dot(s.as, as_group(weights.shared_out), all_tokens, out_acc, add));
      if (out_acc.data != out.out.data) store_rows(out_acc, out.out);
      return Status();
    }));
  }
  if (out.aux_loss) *out.aux_loss = aux_loss;
  if (out.z_loss) *out.z_loss = z;
  if (present(out.tokens_per_expert)) {
    for (int64_t e = 0; e < d.E; ++e) {
      static_cast<int32_t*>(out.tokens_per_expert.data)[e * out.tokens_per_expert.stride[0]] =
          sizes[static_cast<size_t>(e)];
    }
  }
  return {};
}

Status moe_layer_backward(ConstTensorView x, const MoeLayerWeights& weights,
                          const MoeLayerConfig& config, std::span<const std::byte> saved_buf,
                          ConstTensorView d_out, float d_aux_loss, float d_z_loss,
                          std::span<std::byte> scratch_buf, TensorView d_x,
                          const MoeLayerWeightGrads& grads, MoeLayerProfile* profile) {
  constexpr const char* op = "moe_layer_backward";
  Dims d;
  MOEKIT_RETURN_IF_ERROR(check_inputs(op, x, weights, config, d));
  MOEKIT_RETURN_IF_ERROR(check_view(op, "d_out", d_out, 2));
  MOEKIT_RETURN_IF_ERROR(check_same_dtype(op, "d_out", d_out.dtype, "x", d.dt));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "d_out", d_out, 0, d.T, "x.shape[0]"));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "d_out", d_out, 1, d.H, "config.hidden"));
  MOEKIT_RETURN_IF_ERROR(check_view(op, "d_x", d_x, 2));
  MOEKIT_RETURN_IF_ERROR(check_output_dtype(op, "d_x", d_x.dtype, d.dt));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "d_x", d_x, 0, d.T, "x.shape[0]"));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "d_x", d_x, 1, d.H, "config.hidden"));
  for (auto [name, v] : {std::pair{"d_aux_loss", d_aux_loss}, std::pair{"d_z_loss", d_z_loss}}) {
    if (!std::isfinite(v)) {
      return Status::invalid_argument(op, name, fmt::format("{}", v), "must be finite");
    }
  }
  MOEKIT_RETURN_IF_ERROR(check_grad(op, "grads.router", grads.router, weights.router));
  MOEKIT_RETURN_IF_ERROR(check_grad(op, "grads.w_in", grads.w_in, weights.w_in));
  MOEKIT_RETURN_IF_ERROR(check_grad(op, "grads.w_out", grads.w_out, weights.w_out));
  if (d.Fs > 0) {
    MOEKIT_RETURN_IF_ERROR(check_grad(op, "grads.shared_in", grads.shared_in, weights.shared_in));
    MOEKIT_RETURN_IF_ERROR(
        check_grad(op, "grads.shared_out", grads.shared_out, weights.shared_out));
  }
  const MoeLayerWorkspace need = workspace_of(d);
  MOEKIT_RETURN_IF_ERROR(check_workspace(op, "saved", saved_buf, need.saved_bytes));
  MOEKIT_RETURN_IF_ERROR(check_workspace(op, "scratch", scratch_buf, need.backward_bytes));
  if (profile) *profile = {};

  // The saved buffer is only read here; the arena hands out mutable views of it.
  Arena saved_arena(const_cast<std::byte*>(saved_buf.data())), scratch_arena(scratch_buf.data());
  const Saved s = carve_saved(d, saved_arena);
  const BackwardScratch b = carve_backward(d, scratch_arena);
  const int32_t all_tokens[1] = {static_cast<int32_t>(d.T)};
  const auto sizes = group_sizes(s.tokens_per_expert);
  const int64_t rows = used_rows(sizes);

  // d_y [N, H] and the routing weights' gradient [T, k].
  MOEKIT_RETURN_IF_ERROR(timed(profile, MoeStep::kUnpermute, [&] {
    return unpermute_backward(d_out, s.y, s.row_map, s.topk_weights, b.d_y, b.d_topk_weights);
  }));
  MOEKIT_RETURN_IF_ERROR(timed(profile, MoeStep::kGmmDown, [&]() -> Status {
    MOEKIT_RETURN_IF_ERROR(ragged_dot_dlhs(b.d_y, weights.w_out, sizes, b.d_a));
    return ragged_dot_drhs(s.a, b.d_y, sizes, grads.w_out);
  }));
  MOEKIT_RETURN_IF_ERROR(timed(profile, MoeStep::kActivation, [&] {
    return activation_backward(first_rows(s.h, rows), first_rows(b.d_a, rows), config.activation,
                               first_rows(b.d_h, rows));
  }));
  const TensorView d_x_perm = b.d_y;
  MOEKIT_RETURN_IF_ERROR(timed(profile, MoeStep::kGmmUp, [&]() -> Status {
    MOEKIT_RETURN_IF_ERROR(ragged_dot_dlhs(b.d_h, weights.w_in, sizes, d_x_perm));
    return ragged_dot_drhs(s.x_perm, b.d_h, sizes, grads.w_in);
  }));
  // d_x = the sum of each token's k rows; the router and the shared expert add to it below, in
  // f32 (d_x itself, or the scratch rounded into it at the end).
  const TensorView d_x_acc = d_x.dtype == DType::kF32 ? d_x : b.d_x_f32;
  MOEKIT_RETURN_IF_ERROR(timed(profile, MoeStep::kPermute, [&] {
    return permute_backward(d_x_perm, {}, s.row_map, d_x_acc, {});
  }));
  // d_logits [T, E] f32: through the routing weights, the load-balancing loss and the z-loss.
  MOEKIT_RETURN_IF_ERROR(timed(profile, MoeStep::kRoute, [&]() -> Status {
    MOEKIT_RETURN_IF_ERROR(
        route_backward(s.logits, s.topk_indices, {}, b.d_topk_weights, config.route, b.d_logits));
    if (config.aux_loss_coeff != 0.0f) {
      const TensorView counts = d.B > 1 ? s.counts : TensorView(s.counts.data, DType::kI32, {d.E});
      MOEKIT_RETURN_IF_ERROR(
          d.B > 1
              ? seq_load_balancing_loss_backward(counts, lb_options(config), d_aux_loss, b.d_tmp)
              : load_balancing_loss_backward(counts, lb_options(config), d_aux_loss, b.d_tmp));
      MOEKIT_RETURN_IF_ERROR(
          aux_loss_scores_backward(s.logits, b.d_tmp, config.route.score, b.d_tmp2));
      add_into(b.d_logits, b.d_tmp2);
    }
    if (config.z_loss_coeff != 0.0f) {
      MOEKIT_RETURN_IF_ERROR(z_loss_backward(s.logits, config.z_loss_coeff, d_z_loss, b.d_tmp));
      add_into(b.d_logits, b.d_tmp);
    }
    if (d.dt != DType::kF32) store_rows(b.d_logits, b.d_logits_dt);  // x's dtype for the GEMM
    return {};
  }));
  const ConstTensorView router = as_group(weights.router);
  RaggedDotOptions add;
  add.accumulate = true;
  MOEKIT_RETURN_IF_ERROR(timed(profile, MoeStep::kRouterGemm, [&]() -> Status {
    MOEKIT_RETURN_IF_ERROR(ragged_dot_dlhs(b.d_logits_dt, router, all_tokens, d_x_acc, add));
    return ragged_dot_drhs(x, b.d_logits_dt, all_tokens, as_group(grads.router));
  }));
  if (d.Fs > 0) {
    MOEKIT_RETURN_IF_ERROR(timed(profile, MoeStep::kSharedExpert, [&]() -> Status {
      const ConstTensorView w_up = as_group(weights.shared_in),
                            w_down = as_group(weights.shared_out);
      MOEKIT_RETURN_IF_ERROR(ragged_dot_dlhs(d_out, w_down, all_tokens, b.d_as));
      MOEKIT_RETURN_IF_ERROR(ragged_dot_drhs(s.as, d_out, all_tokens, as_group(grads.shared_out)));
      MOEKIT_RETURN_IF_ERROR(activation_backward(s.hs, b.d_as, config.activation, b.d_hs));
      MOEKIT_RETURN_IF_ERROR(ragged_dot_dlhs(b.d_hs, w_up, all_tokens, d_x_acc, add));
      return ragged_dot_drhs(x, b.d_hs, all_tokens, as_group(grads.shared_in));
    }));
  }
  if (d_x_acc.data != d_x.data) {  // one rounding of the f32 sum into d_x
    MOEKIT_RETURN_IF_ERROR(timed(profile, MoeStep::kPermute, [&] {
      store_rows(d_x_acc, d_x);
      return Status();
    }));
  }
  return {};
}

}  // namespace moekit
