// The MoE layer. Its steps are the public calls (router GEMM, route, permute, the grouped
// matmuls, activation, unpermute, shared expert, losses), run in order on buffers carved from
// memory the caller gives: on one rank, the caller's workspace; over P ranks, a state the caller
// keeps. The token side (router, losses, permute; unpermute, shared expert) and the expert side
// (gmm_up, activation, gmm_down) are one code for both: on one rank the expert side runs on
// x_perm itself, over P ranks on the rows ep_dispatch brings, and ep_combine takes them back.
// Every argument is validated before the first step runs; the router and permutation options are
// validated by an empty call of their own op, so that the rules live in one place.
//
// One rank runs on the CPU or on a CUDA device, by the Exec it is given: every step is a call
// that takes it (the public ops, and layer_ops.h's matmuls and row sums), so the code below is
// the same for both. What differs is said where it does: on CUDA the group sizes stay on the
// device (the expert side runs over all of its rows, the ones past the groups being zero), the
// losses are written to device memory, and the ops' workspace is carved from the caller's
// scratch.
#include "moekit/layer.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "check.h"
#include "comm/agree.h"
#include "layer_ops.h"
#include "moekit/ragged_dot.h"
#include "router_problem.h"

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
// The layer's buffers on CUDA start at this alignment (cudaMalloc's), which the ops' workspace
// carved from them needs.
constexpr size_t kCudaAlign = 256;

// The sizes of one layer call.
struct Dims {
  int64_t T, H, F, E, k, N;
  int64_t El;      // experts whose weights this call holds: E on one rank, E / P over P ranks
  int64_t W;       // gmm_up's output width: 2F gated, F otherwise
  int64_t Fs, Ws;  // the shared expert's width and its up width (0: none)
  int64_t B;       // rows of the aux-loss counts: the sequences, or 1
  DType dt;        // x, weights and activations
  Device dev = Device::kCpu;  // where the buffers are
};

// Carves 64-byte aligned tensors out of one buffer, in order; with a null base it only counts
// the bytes. A count past size_t sticks at SIZE_MAX (check_config refuses such a layer before
// any buffer is laid out).
class Arena {
 public:
  explicit Arena(std::byte* base) : base_(base) {}
  // `bytes` bytes at a multiple of `align` from the base (which the caller aligned as much).
  void* take_bytes(size_t bytes, size_t align) {
    if (used_ == SIZE_MAX || __builtin_add_overflow(used_, align - 1, &used_)) {
      used_ = SIZE_MAX;
      return nullptr;
    }
    used_ = used_ / align * align;
    void* p = base_ ? base_ + used_ : nullptr;
    if (__builtin_add_overflow(used_, bytes, &used_)) used_ = SIZE_MAX;
    return p;
  }
  TensorView take(DType t, std::initializer_list<int64_t> shape) {
    int64_t n = 1;
    bool fits = true;
    for (int64_t d : shape) fits = fits && detail::mul_fits(n, d, &n);
    void* p = base_ ? base_ + used_ : nullptr;
    size_t bytes = 0;
    fits = fits && !__builtin_mul_overflow(static_cast<size_t>(n), dtype_size(t), &bytes) &&
           !__builtin_add_overflow(bytes, kAlign - 1, &bytes) &&
           !__builtin_add_overflow(used_, bytes / kAlign * kAlign, &used_);
    if (!fits) used_ = SIZE_MAX;
    return TensorView(p, t, shape);
  }
  size_t used() const { return used_; }
  bool overflowed() const { return used_ == SIZE_MAX; }

 private:
  std::byte* base_;
  size_t used_ = 0;
};

// What the forward saves for the backward. The expert side's rows are R: the rows of this rank's
// experts (on one rank R = N, and x_rows is x_perm itself).
struct Saved {
  TensorView logits, topk_indices, topk_weights, tokens_per_expert, row_map, counts;
  TensorView x_rows, h, a;  // [R, H], [R, 2F | F], [R, F]: the grouped matmuls' inputs
  TensorView y_perm;        // [N, H]: the experts' outputs in x_perm's order (unpermute's input)
  TensorView hs, as;        // the shared expert's, [T, 2Fs | Fs], [T, Fs]
};

void carve_token_saved(const Dims& d, Arena& m, Saved& s) {
  s.logits = m.take(DType::kF32, {d.T, d.E});
  s.topk_indices = m.take(DType::kI32, {d.T, d.k});
  s.topk_weights = m.take(DType::kF32, {d.T, d.k});
  s.tokens_per_expert = m.take(DType::kI32, {d.E});
  s.row_map = m.take(DType::kI32, {2, d.T, d.k});
  s.counts = m.take(DType::kI32, {d.B, d.E});
}
void carve_expert_saved(const Dims& d, int64_t R, Arena& m, Saved& s) {
  s.x_rows = m.take(d.dt, {R, d.H});
  s.h = m.take(d.dt, {R, d.W});
  s.a = m.take(d.dt, {R, d.F});
}
void carve_shared_saved(const Dims& d, Arena& m, Saved& s) {
  if (d.Fs > 0) {
    s.hs = m.take(d.dt, {d.T, d.Ws});
    s.as = m.take(d.dt, {d.T, d.Fs});
  }
}
// One rank: the order include/moekit/layer.h states (x_perm, h, a, y after the routing).
Saved carve_saved(const Dims& d, Arena& m) {
  Saved s;
  carve_token_saved(d, m, s);
  carve_expert_saved(d, d.N, m, s);
  s.y_perm = m.take(d.dt, {d.N, d.H});
  carve_shared_saved(d, m, s);
  return s;
}

// The forward's scratch: the aux-loss scores and their routing map; over P ranks also x_perm
// (dead once dispatched) and the experts' outputs before the combine. With a shared expert and
// bf16 x, out_f32 [T, H] sums the routed experts' and the shared expert's outputs in f32, rounded
// once into out, as d_x in the backward.
// `exec` is the pass's: its device and stream, and on CUDA its ops' workspace (carve_ops).
// losses [2] f32 (aux, z) is where the losses are written on CUDA (device memory).
struct ForwardScratch {
  TensorView scores, aux_map, out_f32;
  TensorView x_perm, y_rows;  // one rank: the saved x_rows and y_perm themselves
  TensorView losses;
  Exec exec;
};

// The bytes the ops of a pass need as their workspace on d.dev (none on the CPU): the largest
// of the ragged_dot, router, permutation and cuBLAS workspaces, shared on the pass's stream.
size_t ops_bytes(const Dims& d) {
  if (d.dev == Device::kCpu) return 0;
  return std::max({ragged_dot_workspace_size(d.dev, d.El), router_workspace_size(d.dev, d.T, d.E),
                   permute_workspace_size(d.dev, d.T, d.k, d.E, d.N),
                   detail::dense_dot_workspace_size(d.dev)});
}
// The pass's Exec: the caller's device and stream, and the ops' workspace from the arena.
Exec carve_ops(const Dims& d, const Exec& caller, Arena& m) {
  Exec e = caller;
  e.workspace_bytes = ops_bytes(d);
  e.workspace = e.workspace_bytes > 0 ? m.take_bytes(e.workspace_bytes, kCudaAlign) : nullptr;
  return e;
}

ForwardScratch carve_forward(const Dims& d, Arena& m, const Exec& exec = {}) {
  ForwardScratch s{
      m.take(DType::kF32, {d.T, d.E}), m.take(DType::kBool, {d.T, d.E}), {}, {}, {}, {}, {}};
  if (d.Fs > 0 && d.dt != DType::kF32) s.out_f32 = m.take(DType::kF32, {d.T, d.H});
  s.losses = m.take(DType::kF32, {2});
  s.exec = carve_ops(d, exec, m);
  return s;
}

// The backward's scratch. d_y_perm [N, H] also serves as d_x_perm, and d_rows [R, H] holds the
// expert side's d_y and then its d_x (each dead by the time the next is written); on one rank
// the two are one buffer.
struct BackwardScratch {
  TensorView d_y_perm, d_rows, d_a, d_h;
  TensorView d_topk_weights, d_logits, d_tmp, d_tmp2, d_logits_dt, d_as, d_hs;
  // [T, H] f32 with bf16 x: d_x's three terms (the experts', the router's, the shared expert's)
  // summed in f32 and rounded once.
  TensorView d_x_f32;
  // Over P ranks, with gradients not in f32: the replicated weights' gradients in f32, summed
  // over the ranks before they are rounded once.
  TensorView d_router_f32, d_shared_in_f32, d_shared_out_f32;
  Exec exec;  // as ForwardScratch's
};
void carve_token_backward(const Dims& d, Arena& m, BackwardScratch& s) {
  s.d_y_perm = m.take(d.dt, {d.N, d.H});
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
}
void carve_expert_backward(const Dims& d, int64_t R, Arena& m, BackwardScratch& s) {
  s.d_a = m.take(d.dt, {R, d.F});
  s.d_h = m.take(d.dt, {R, d.W});
}
BackwardScratch carve_backward(const Dims& d, Arena& m, const Exec& exec = {}) {
  BackwardScratch s;
  carve_token_backward(d, m, s);
  s.d_rows = s.d_y_perm;
  carve_expert_backward(d, d.N, m, s);
  s.exec = carve_ops(d, exec, m);
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
  // Sizes in int32's range: products of a few of them then fit int64 (2F, T * E, ...).
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  auto in_range = [&](const char* name, int64_t v, int64_t lo, const char* what) -> Status {
    if (v >= lo && v <= kMax) return {};
    return Status::invalid_argument(op, name, std::to_string(v), what);
  };
  MOEKIT_RETURN_IF_ERROR(in_range("config.hidden", c.hidden, 1, "must be in [1, 2^31 - 1]"));
  MOEKIT_RETURN_IF_ERROR(in_range("config.ffn", c.ffn, 1, "must be in [1, 2^31 - 1]"));
  MOEKIT_RETURN_IF_ERROR(
      in_range("config.num_experts", c.num_experts, 1, "must be in [1, 2^31 - 1]"));
  MOEKIT_RETURN_IF_ERROR(in_range("config.shared_ffn", c.shared_ffn, 0,
                                  "must be in [0, 2^31 - 1] (0: no shared expert)"));
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
  d.El = d.E;
  d.W = gated ? 2 * d.F : d.F;
  d.Fs = c.shared_ffn, d.Ws = gated ? 2 * d.Fs : d.Fs;
  d.B = c.aux_loss_sequences > 0 ? c.aux_loss_sequences : 1;
  // The workspace in the widest dtype, counted without wrapping: it bounds every other one.
  Dims widest = d;
  widest.dt = DType::kF32;
  const MoeLayerWorkspace w = workspace_of(widest);
  for (size_t bytes : {w.saved_bytes, w.forward_bytes, w.backward_bytes}) {
    if (bytes == SIZE_MAX) {
      return Status::invalid_argument(
          op, "config",
          fmt::format("hidden {}, ffn {}, shared_ffn {}, {} experts, {} tokens", c.hidden, c.ffn,
                      c.shared_ffn, c.num_experts, T),
          "the layer's workspace does not fit a 64-bit size");
    }
  }
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

// The experts' weights: [E, in, out], or [E, out, in] (config.expert_weights_transposed).
Status check_expert_weights(const char* op, const MoeLayerWeights& w, const Dims& d,
                            const MoeLayerConfig& c) {
  const bool local = d.El != d.E;  // over P ranks: this rank's experts only
  const bool t = c.expert_weights_transposed;
  auto expert_weight = [&](const char* name, const ConstTensorView& v, int64_t in, int64_t out,
                           const char* in_name, const char* out_name, const char* note) {
    const std::string dims =
        fmt::format("[{}, {}, {}]{}{}", local ? "E_loc" : "E", t ? out_name : in_name,
                    t ? in_name : out_name, note, t ? " (config.expert_weights_transposed)" : "");
    return check_weight(op, name, v, d.dt, {d.El, t ? out : in, t ? in : out}, dims.c_str());
  };
  MOEKIT_RETURN_IF_ERROR(
      d.W == d.F ? expert_weight("weights.w_in", w.w_in, d.H, d.W, "H", "F", "")
                 : expert_weight("weights.w_in", w.w_in, d.H, d.W, "H", "2F", " (gate | up)"));
  MOEKIT_RETURN_IF_ERROR(expert_weight("weights.w_out", w.w_out, d.F, d.H, "F", "H", ""));
  return {};
}

// The experts' weights packed (config.expert_weights_packed): bf16 or f32 on the CPU, w_in and
// w_out as packed_rhs_shape says.
Status check_packed_experts(const char* op, const MoeLayerWeights& w, const Dims& d,
                            const MoeLayerConfig& c) {
  if (c.expert_weights_transposed) {
    return Status::invalid_argument(op, "config.expert_weights_transposed", "true",
                                    "packed weights have one layout: it must be false with "
                                    "config.expert_weights_packed");
  }
  if (d.dev != Device::kCpu || (d.dt != DType::kBF16 && d.dt != DType::kF32)) {
    return Status::invalid_argument(
        op, "config.expert_weights_packed", "true",
        fmt::format("packed weights serve the CPU's bf16 and f32 forward (here {} on {})",
                    dtype_name(d.dt), d.dev == Device::kCpu ? "the CPU" : "CUDA"));
  }
  const bool local = d.El != d.E;
  auto packed = [&](const char* name, const ConstTensorView& v, int64_t K, int64_t n,
                    const char* from) {
    const PackedRhsShape s = packed_rhs_shape(d.El, K, n, d.dt);
    const std::string what = fmt::format("{} packed (packed_rhs_shape)", from);
    return check_weight(op, name, v, d.dt, {s.dims[0], s.dims[1], s.dims[2]}, what.c_str());
  };
  MOEKIT_RETURN_IF_ERROR(packed("weights.w_in", w.w_in, d.H, d.W,
                                local ? (d.W == d.F ? "[E_loc, H, F]" : "[E_loc, H, 2F]")
                                      : (d.W == d.F ? "[E, H, F]" : "[E, H, 2F]")));
  return packed("weights.w_out", w.w_out, d.F, d.H, local ? "[E_loc, F, H]" : "[E, F, H]");
}

Status check_weights(const char* op, const MoeLayerWeights& w, const Dims& d,
                     const MoeLayerConfig& c) {
  MOEKIT_RETURN_IF_ERROR(check_weight(op, "weights.router", w.router, d.dt, {d.H, d.E}, "[H, E]"));
  const bool local = d.El != d.E;  // over P ranks: this rank's experts only
  if (c.expert_weights_packed) {
    MOEKIT_RETURN_IF_ERROR(check_packed_experts(op, w, d, c));
  } else {
    MOEKIT_RETURN_IF_ERROR(check_expert_weights(op, w, d, c));
  }
  if (present(w.b_in)) {
    MOEKIT_RETURN_IF_ERROR(check_weight(
        op, "weights.b_in", w.b_in, d.dt, {d.El, d.W},
        d.W == d.F ? (local ? "[E_loc, F]" : "[E, F]") : (local ? "[E_loc, 2F]" : "[E, 2F]")));
  }
  if (present(w.b_out)) {
    MOEKIT_RETURN_IF_ERROR(check_weight(op, "weights.b_out", w.b_out, d.dt, {d.El, d.H},
                                        local ? "[E_loc, H]" : "[E, H]"));
  }
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

Status check_workspace(const char* op, const char* name, std::span<const std::byte> s, size_t need,
                       Device dev) {
  if (s.size() < need) {
    return Status::invalid_argument(op, fmt::format("{}.size()", name), std::to_string(s.size()),
                                    fmt::format("needs {} bytes (moe_layer_workspace)", need));
  }
  const size_t align = dev == Device::kCuda ? kCudaAlign : kAlign;
  if (need > 0 && reinterpret_cast<uintptr_t>(s.data()) % align != 0) {
    return Status::invalid_argument(op, fmt::format("{}.data()", name),
                                    fmt::format("{}", static_cast<const void*>(s.data())),
                                    fmt::format("must be {}-byte aligned", align));
  }
  return {};
}

// x, the config and the weights: fills d. ranks > 1: w_in and w_out hold E / ranks experts.
Status check_inputs(const char* op, const ConstTensorView& x, const MoeLayerWeights& w,
                    const MoeLayerConfig& c, Dims& d, int ranks = 1, const Exec& exec = {}) {
  MOEKIT_RETURN_IF_ERROR(detail::check_exec(op, exec));
  if (exec.device == Device::kCuda) {
    if (c.batch_invariant) {
      return Status::unimplemented(op,
                                   "config.batch_invariant: the batch-invariant mode runs on "
                                   "the CPU only");
    }
    if (c.num_experts > detail::kRouterMaxCudaExperts) {
      return Status::unimplemented(
          op, fmt::format("config.num_experts = {}: the CUDA router takes at most {} experts",
                          c.num_experts, detail::kRouterMaxCudaExperts));
    }
  }
  MOEKIT_RETURN_IF_ERROR(check_view(op, "x", x, 2));
  MOEKIT_RETURN_IF_ERROR(check_input_dtype(op, "x", x.dtype));
  MOEKIT_RETURN_IF_ERROR(check_config(op, c, x.shape[0], d));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "x", x, 1, c.hidden, "config.hidden"));
  if (d.E % ranks != 0) {
    return Status::invalid_argument(
        op, "config.num_experts", std::to_string(d.E),
        fmt::format("the experts must be divisible by the {} ranks", ranks));
  }
  d.El = d.E / ranks;
  d.dt = x.dtype;
  d.dev = exec.device;
  return check_weights(op, w, d, c);
}

// The backward refuses packed experts' weights: it needs the weights' transposes, which the
// packed layout does not give.
Status check_backward_not_packed(const char* op, const MoeLayerConfig& c) {
  if (!c.expert_weights_packed) return {};
  return Status::invalid_argument(op, "config.expert_weights_packed", "true",
                                  "packed weights serve the forward only (inference): the "
                                  "backward takes the weights unpacked");
}

// A view of the first `rows` rows.
template <class View>
View first_rows(View v, int64_t rows) {
  v.shape[0] = rows;
  return v;
}

// The options of every matmul of the layer: the config's batch-invariant mode, and whether the
// product adds into its output.
RaggedDotOptions gemm(const MoeLayerConfig& config, bool accumulate = false) {
  RaggedDotOptions o;
  o.batch_invariant = config.batch_invariant;
  o.accumulate = accumulate;
  return o;
}

// The grouped matmuls' options: gemm's, with the experts' weights as they lie.
RaggedDotOptions expert_gemm(const MoeLayerConfig& config) {
  RaggedDotOptions o = gemm(config);
  o.rhs_transposed = config.expert_weights_transposed;
  o.rhs_packed = config.expert_weights_packed;
  return o;
}

// Runs one step, adding its wall time to the profile when there is one (on CUDA the time from
// an idle stream to the step's end: the stream is waited for on both sides).
template <class Fn>
Status timed(MoeLayerProfile* profile, const Exec& exec, MoeStep step, Fn fn) {
  if (!profile) return fn();
  MOEKIT_RETURN_IF_ERROR(detail::synchronize(exec));
  const auto t0 = std::chrono::steady_clock::now();
  Status s = fn();
  if (s.ok()) s = detail::synchronize(exec);
  profile->ms[static_cast<int>(step)] +=
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return s;
}

std::span<const int32_t> group_sizes(const TensorView& tokens_per_expert) {
  return {static_cast<const int32_t*>(tokens_per_expert.data),
          static_cast<size_t>(tokens_per_expert.shape[0])};
}

// The rows the expert side computes, of the `rows` it holds: on the CPU the sum of the group
// sizes (the host reads them), on CUDA all of them (the sizes are on the device; the rows past
// the groups are zero, and stay zero through the activation).
int64_t used_rows(std::span<const int32_t> sizes, int64_t rows, const Exec& exec) {
  if (exec.device != Device::kCpu) return rows;
  return std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
}

LoadBalancingOptions lb_options(const MoeLayerConfig& c) {
  LoadBalancingOptions o;
  o.k = c.route.k;
  o.coeff = c.aux_loss_coeff;
  return o;
}

// The other ranks, as the token side sees them: nobody on one rank. Over P ranks, the losses
// are the group's: the load-balancing loss takes the group's counts and token count, the
// sequence-level loss averages over every rank's sequences, the z-loss over every token. Each
// rank computes its share, weighted so that the shares sum to the group's loss.
struct Group {
  Communicator* comm = nullptr;
  int64_t total_tokens = 0;  // T summed over the ranks
  int ranks = 1;

  float seq_weight() const { return 1.0f / static_cast<float>(ranks); }
  float z_weight(int64_t T) const {
    if (!comm) return 1.0f;
    return total_tokens > 0 ? static_cast<float>(static_cast<double>(T) / total_tokens) : 0.0f;
  }
  // Batch-level load balancing over no tokens at all has no value: it is 0.
  bool batch_loss_defined() const { return !comm || total_tokens > 0; }
};

// Router GEMM, route, the losses (the group's, the same on every rank) and permute: this rank's
// tokens, up to x_perm and the rows per expert. The losses go to losses[0] (aux) and losses[1]
// (z), in the pass's memory (f.losses on CUDA, the host's on the CPU).
Status forward_tokens(const ConstTensorView& x, const MoeLayerWeights& weights,
                      const MoeLayerConfig& config, const Dims& d, const Saved& s,
                      const ForwardScratch& f, const Group& g, float* losses,
                      MoeLayerProfile* profile) {
  const Exec& exec = f.exec;
  // logits [T, E] f32 = x @ router.
  MOEKIT_RETURN_IF_ERROR(timed(profile, exec, MoeStep::kRouterGemm, [&] {
    return detail::dense_dot(x, weights.router, s.logits, gemm(config), exec);
  }));
  MOEKIT_RETURN_IF_ERROR(timed(profile, exec, MoeStep::kRoute, [&]() -> Status {
    MOEKIT_RETURN_IF_ERROR(
        route(s.logits, config.route, {{}, {}, s.topk_indices, s.topk_weights}, exec));
    MOEKIT_RETURN_IF_ERROR(detail::zero_bytes(losses, 2 * sizeof(float), exec));
    if (config.aux_loss_coeff != 0.0f) {
      MOEKIT_RETURN_IF_ERROR(aux_loss_scores(s.logits, config.route.k, config.route.score, f.scores,
                                             f.aux_map, RouterImpl::kAuto, exec));
      const TensorView counts = d.B > 1 ? s.counts : TensorView(s.counts.data, DType::kI32, {d.E});
      MOEKIT_RETURN_IF_ERROR(count_tokens_per_expert(f.aux_map, counts, exec));
      if (d.B > 1) {
        if (d.T > 0) {
          MOEKIT_RETURN_IF_ERROR(
              seq_load_balancing_loss(f.scores, counts, lb_options(config), &losses[0], exec));
          if (g.comm) losses[0] *= g.seq_weight();
        }
      } else {
        LoadBalancingOptions o = lb_options(config);
        if (g.comm) {
          MOEKIT_RETURN_IF_ERROR(g.comm->all_reduce_sum(counts.data, d.E, DType::kI32));
          o.total_tokens = g.total_tokens;
        }
        if (g.batch_loss_defined()) {
          MOEKIT_RETURN_IF_ERROR(load_balancing_loss(f.scores, counts, o, &losses[0], exec));
        }
      }
    }
    if (config.z_loss_coeff != 0.0f) {
      MOEKIT_RETURN_IF_ERROR(z_loss(s.logits, config.z_loss_coeff, &losses[1], exec));
      if (g.comm) losses[1] *= g.z_weight(d.T);
    }
    if (g.comm) MOEKIT_RETURN_IF_ERROR(g.comm->all_reduce_sum(losses, 2, DType::kF32));
    return {};
  }));
  // x_perm [N, H]: expert-major rows; the capacity's probs policy ranks by the routing weights.
  const bool by_probs = config.capacity_factor > 0.0 && config.drop_policy == DropPolicy::kProbs;
  return timed(profile, exec, MoeStep::kPermute, [&] {
    return permute(
        x, s.topk_indices, by_probs ? ConstTensorView(s.topk_weights) : ConstTensorView{},
        permute_options(config), {f.x_perm, {}, s.tokens_per_expert, s.row_map, {}}, exec);
  });
}

// gmm_up, the activation and gmm_down on the rows of the experts this call holds, grouped by
// `sizes` (in the memory of exec's device): x_rows [R, H] -> y_rows [R, H].
Status forward_experts(const MoeLayerWeights& weights, const MoeLayerConfig& config,
                       std::span<const int32_t> sizes, const Saved& s, const TensorView& y_rows,
                       const Exec& exec, MoeLayerProfile* profile) {
  const int64_t rows = used_rows(sizes, s.x_rows.shape[0], exec);
  MOEKIT_RETURN_IF_ERROR(timed(profile, exec, MoeStep::kGmmUp, [&]() -> Status {
    MOEKIT_RETURN_IF_ERROR(
        ragged_dot(s.x_rows, weights.w_in, sizes, s.h, expert_gemm(config), exec));
    if (!present(weights.b_in)) return {};
    return detail::add_group_bias(s.h, sizes, weights.b_in, exec);
  }));
  MOEKIT_RETURN_IF_ERROR(timed(profile, exec, MoeStep::kActivation, [&] {
    return activation(first_rows(s.h, rows), config.activation, first_rows(s.a, rows),
                      ActivationImpl::kAuto, exec);
  }));
  return timed(profile, exec, MoeStep::kGmmDown, [&]() -> Status {
    MOEKIT_RETURN_IF_ERROR(
        ragged_dot(s.a, weights.w_out, sizes, y_rows, expert_gemm(config), exec));
    if (!present(weights.b_out)) return {};
    return detail::add_group_bias(y_rows, sizes, weights.b_out, exec);
  });
}

// unpermute and the shared expert: y_perm [N, H] back to this rank's tokens.
Status forward_finish(const ConstTensorView& x, const MoeLayerWeights& weights,
                      const MoeLayerConfig& config, const Dims& d, const Saved& s,
                      const ForwardScratch& f, const TensorView& out, MoeLayerProfile* profile) {
  const Exec& exec = f.exec;
  const TensorView out_acc = f.out_f32.data ? f.out_f32 : out;
  MOEKIT_RETURN_IF_ERROR(timed(profile, exec, MoeStep::kUnpermute, [&] {
    return unpermute(s.y_perm, s.row_map, s.topk_weights, out_acc, PermuteImpl::kAuto, exec);
  }));
  if (d.Fs == 0) return {};
  return timed(profile, exec, MoeStep::kSharedExpert, [&]() -> Status {
    MOEKIT_RETURN_IF_ERROR(detail::dense_dot(x, weights.shared_in, s.hs, gemm(config), exec));
    MOEKIT_RETURN_IF_ERROR(activation(s.hs, config.activation, s.as, ActivationImpl::kAuto, exec));
    MOEKIT_RETURN_IF_ERROR(
        detail::dense_dot(s.as, weights.shared_out, out_acc, gemm(config, true), exec));
    if (out_acc.data != out.data) MOEKIT_RETURN_IF_ERROR(detail::convert_rows(out_acc, out, exec));
    return Status();
  });
}

// The expert side backward: d_rows holds d_y [R, H] on entry and d_x of the rows on return;
// the experts' own weight gradients.
Status backward_experts(const MoeLayerWeights& weights, const MoeLayerConfig& config,
                        std::span<const int32_t> sizes, const Saved& s, const BackwardScratch& b,
                        const MoeLayerWeightGrads& grads, MoeLayerProfile* profile) {
  const Exec& exec = b.exec;
  const int64_t rows = used_rows(sizes, s.x_rows.shape[0], exec);
  MOEKIT_RETURN_IF_ERROR(timed(profile, exec, MoeStep::kGmmDown, [&]() -> Status {
    if (present(grads.b_out)) {
      MOEKIT_RETURN_IF_ERROR(detail::group_sums(b.d_rows, sizes, grads.b_out, exec));
    }
    MOEKIT_RETURN_IF_ERROR(
        ragged_dot_dlhs(b.d_rows, weights.w_out, sizes, b.d_a, expert_gemm(config), exec));
    return ragged_dot_drhs(s.a, b.d_rows, sizes, grads.w_out, expert_gemm(config), exec);
  }));
  MOEKIT_RETURN_IF_ERROR(timed(profile, exec, MoeStep::kActivation, [&] {
    return activation_backward(first_rows(s.h, rows), first_rows(b.d_a, rows), config.activation,
                               first_rows(b.d_h, rows), ActivationImpl::kAuto, exec);
  }));
  return timed(profile, exec, MoeStep::kGmmUp, [&]() -> Status {
    if (present(grads.b_in)) {
      MOEKIT_RETURN_IF_ERROR(detail::group_sums(b.d_h, sizes, grads.b_in, exec));
    }
    MOEKIT_RETURN_IF_ERROR(
        ragged_dot_dlhs(b.d_h, weights.w_in, sizes, b.d_rows, expert_gemm(config), exec));
    return ragged_dot_drhs(s.x_rows, b.d_h, sizes, grads.w_in, expert_gemm(config), exec);
  });
}

// Where the token side's backward writes the replicated weights' gradients: the caller's, or
// (over P ranks, when those are not f32) f32 scratch that is summed over the ranks first.
struct ReplicatedGrads {
  TensorView router, shared_in, shared_out;
};

// The token side backward, from d_x_perm (in b.d_y_perm): permute's, the router's (through the
// routing weights and the losses) and the shared expert's, into d_x and the replicated weights'
// gradients.
Status backward_tokens(const ConstTensorView& x, const MoeLayerWeights& weights,
                       const MoeLayerConfig& config, const Dims& d, const Saved& s,
                       const BackwardScratch& b, const Group& g, ConstTensorView d_out,
                       float d_aux_loss, float d_z_loss, const TensorView& d_x,
                       const ReplicatedGrads& grads, MoeLayerProfile* profile) {
  const Exec& exec = b.exec;
  // d_x = the sum of each token's k rows; the router and the shared expert add to it below, in
  // f32 (d_x itself, or the scratch rounded into it at the end).
  const TensorView d_x_acc = d_x.dtype == DType::kF32 ? d_x : b.d_x_f32;
  MOEKIT_RETURN_IF_ERROR(timed(profile, exec, MoeStep::kPermute, [&] {
    return permute_backward(b.d_y_perm, {}, s.row_map, d_x_acc, {}, PermuteImpl::kAuto, exec);
  }));
  // d_logits [T, E] f32: through the routing weights, the load-balancing loss and the z-loss.
  MOEKIT_RETURN_IF_ERROR(timed(profile, exec, MoeStep::kRoute, [&]() -> Status {
    MOEKIT_RETURN_IF_ERROR(route_backward(s.logits, s.topk_indices, {}, b.d_topk_weights,
                                          config.route, b.d_logits, exec));
    if (config.aux_loss_coeff != 0.0f && g.batch_loss_defined() && (d.B == 1 || d.T > 0)) {
      const TensorView counts = d.B > 1 ? s.counts : TensorView(s.counts.data, DType::kI32, {d.E});
      LoadBalancingOptions o = lb_options(config);
      if (g.comm && d.B == 1) o.total_tokens = g.total_tokens;
      MOEKIT_RETURN_IF_ERROR(
          d.B > 1 ? seq_load_balancing_loss_backward(counts, o, d_aux_loss * g.seq_weight(),
                                                     b.d_tmp, exec)
                  : load_balancing_loss_backward(counts, o, d_aux_loss, b.d_tmp, exec));
      MOEKIT_RETURN_IF_ERROR(aux_loss_scores_backward(s.logits, b.d_tmp, config.route.score,
                                                      b.d_tmp2, RouterImpl::kAuto, exec));
      MOEKIT_RETURN_IF_ERROR(detail::add_rows(b.d_logits, b.d_tmp2, exec));
    }
    if (config.z_loss_coeff != 0.0f) {
      MOEKIT_RETURN_IF_ERROR(z_loss_backward(s.logits, config.z_loss_coeff,
                                             d_z_loss * g.z_weight(d.T), b.d_tmp, exec));
      MOEKIT_RETURN_IF_ERROR(detail::add_rows(b.d_logits, b.d_tmp, exec));
    }
    if (d.dt != DType::kF32) {  // x's dtype for the GEMM
      MOEKIT_RETURN_IF_ERROR(detail::convert_rows(b.d_logits, b.d_logits_dt, exec));
    }
    return {};
  }));
  const RaggedDotOptions add = gemm(config, true);
  MOEKIT_RETURN_IF_ERROR(timed(profile, exec, MoeStep::kRouterGemm, [&]() -> Status {
    MOEKIT_RETURN_IF_ERROR(
        detail::dense_dot_dlhs(b.d_logits_dt, weights.router, d_x_acc, add, exec));
    return detail::dense_dot_drhs(x, b.d_logits_dt, grads.router, gemm(config), exec);
  }));
  if (d.Fs > 0) {
    MOEKIT_RETURN_IF_ERROR(timed(profile, exec, MoeStep::kSharedExpert, [&]() -> Status {
      MOEKIT_RETURN_IF_ERROR(
          detail::dense_dot_dlhs(d_out, weights.shared_out, b.d_as, gemm(config), exec));
      MOEKIT_RETURN_IF_ERROR(
          detail::dense_dot_drhs(s.as, d_out, grads.shared_out, gemm(config), exec));
      MOEKIT_RETURN_IF_ERROR(activation_backward(s.hs, b.d_as, config.activation, b.d_hs,
                                                 ActivationImpl::kAuto, exec));
      MOEKIT_RETURN_IF_ERROR(detail::dense_dot_dlhs(b.d_hs, weights.shared_in, d_x_acc, add, exec));
      return detail::dense_dot_drhs(x, b.d_hs, grads.shared_in, gemm(config), exec);
    }));
  }
  if (d_x_acc.data != d_x.data) {  // one rounding of the f32 sum into d_x
    MOEKIT_RETURN_IF_ERROR(timed(profile, exec, MoeStep::kPermute,
                                 [&] { return detail::convert_rows(d_x_acc, d_x, exec); }));
  }
  return {};
}

// The output checks both layers share.
Status check_outputs(const char* op, const Dims& d, const MoeLayerOutputs& out) {
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
  return {};
}

// The backward's checks both layers share.
Status check_backward_args(const char* op, const Dims& d, const MoeLayerWeights& weights,
                           ConstTensorView d_out, float d_aux_loss, float d_z_loss,
                           const TensorView& d_x, const MoeLayerWeightGrads& grads) {
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
  // The biases' gradients exactly where the weights have biases.
  for (auto [name, g, w] : {std::tuple{"grads.b_in", grads.b_in, weights.b_in},
                            std::tuple{"grads.b_out", grads.b_out, weights.b_out}}) {
    if (present(w) != present(g)) {
      return present(w) ? Status::invalid_argument(op, name, "absent",
                                                   "the weights have this bias: its gradient is "
                                                   "an output")
                        : Status::invalid_argument(op, name, shape_str(g),
                                                   "given, but the weights have no such bias");
    }
    if (present(w)) MOEKIT_RETURN_IF_ERROR(check_grad(op, name, g, w));
  }
  return {};
}

// No output of a layer call (the workspace the call writes included) shares memory with an
// input or another output. The inputs both passes read, then each pass's own.
std::vector<detail::Region> layer_inputs(ConstTensorView x, const MoeLayerWeights& w,
                                         const MoeLayerConfig& c) {
  return {{"x", x},
          {"weights.router", w.router},
          {"weights.w_in", w.w_in},
          {"weights.w_out", w.w_out},
          {"weights.shared_in", w.shared_in},
          {"weights.shared_out", w.shared_out},
          {"weights.b_in", w.b_in},
          {"weights.b_out", w.b_out},
          {"config.route.expert_bias", c.route.expert_bias}};
}
Status check_forward_disjoint(const char* op, ConstTensorView x, const MoeLayerWeights& w,
                              const MoeLayerConfig& c, const MoeLayerOutputs& out,
                              std::span<const std::byte> saved,
                              std::span<const std::byte> scratch) {
  const detail::Region outputs[] = {{"out.out", out.out},
                                    {"out.tokens_per_expert", out.tokens_per_expert},
                                    {"out.aux_loss", out.aux_loss, sizeof(float)},
                                    {"out.z_loss", out.z_loss, sizeof(float)},
                                    {"saved", saved},
                                    {"scratch", scratch}};
  return detail::check_disjoint(op, outputs, layer_inputs(x, w, c));
}
Status check_backward_disjoint(const char* op, ConstTensorView x, const MoeLayerWeights& w,
                               const MoeLayerConfig& c, ConstTensorView d_out,
                               const TensorView& d_x, const MoeLayerWeightGrads& g,
                               std::span<const std::byte> saved,
                               std::span<const std::byte> scratch) {
  const detail::Region outputs[] = {{"d_x", d_x},
                                    {"grads.router", g.router},
                                    {"grads.w_in", g.w_in},
                                    {"grads.w_out", g.w_out},
                                    {"grads.shared_in", g.shared_in},
                                    {"grads.shared_out", g.shared_out},
                                    {"grads.b_in", g.b_in},
                                    {"grads.b_out", g.b_out},
                                    {"scratch", scratch}};
  std::vector<detail::Region> inputs = layer_inputs(x, w, c);
  inputs.insert(inputs.end(), {{"d_out", d_out}, {"saved", saved}});
  return detail::check_disjoint(op, outputs, inputs);
}

}  // namespace

const char* moe_step_name(MoeStep s) {
  static constexpr const char* kNames[kMoeSteps] = {
      "router_gemm", "route",     "permute", "gmm_up",   "activation",
      "gmm_down",    "unpermute", "shared",  "dispatch", "combine"};
  const int i = static_cast<int>(s);
  return i >= 0 && i < kMoeSteps ? kNames[i] : "?";
}

int64_t moe_layer_rows(const MoeLayerConfig& config, int64_t tokens) {
  Dims d;
  if (tokens < 0 || !check_config("moe_layer_rows", config, tokens, d).ok()) return -1;
  return d.N;
}

MoeLayerWorkspace moe_layer_workspace(const MoeLayerConfig& config, int64_t tokens, DType dtype,
                                      Device device) {
  Dims d;
  if (tokens < 0 || !check_config("moe_layer_workspace", config, tokens, d).ok()) return {};
  if (device != Device::kCpu && device != Device::kCuda) return {};
  d.dt = dtype;
  d.dev = device;
  return workspace_of(d);
}

Status moe_layer_forward(ConstTensorView x, const MoeLayerWeights& weights,
                         const MoeLayerConfig& config, std::span<std::byte> saved_buf,
                         std::span<std::byte> scratch_buf, const MoeLayerOutputs& out,
                         MoeLayerProfile* profile, const Exec& exec) {
  constexpr const char* op = "moe_layer_forward";
  Dims d;
  MOEKIT_RETURN_IF_ERROR(check_inputs(op, x, weights, config, d, 1, exec));
  MOEKIT_RETURN_IF_ERROR(check_outputs(op, d, out));
  const MoeLayerWorkspace need = workspace_of(d);
  MOEKIT_RETURN_IF_ERROR(check_workspace(op, "saved", saved_buf, need.saved_bytes, d.dev));
  MOEKIT_RETURN_IF_ERROR(check_workspace(op, "scratch", scratch_buf, need.forward_bytes, d.dev));
  MOEKIT_RETURN_IF_ERROR(
      check_forward_disjoint(op, x, weights, config, out, saved_buf, scratch_buf));
  if (profile) *profile = {};

  Arena saved_arena(saved_buf.data()), scratch_arena(scratch_buf.data());
  const Saved s = carve_saved(d, saved_arena);
  ForwardScratch f = carve_forward(d, scratch_arena, exec);
  f.x_perm = s.x_rows;  // one rank: the experts' rows are x_perm's
  // The losses where the ops write them: the host's on the CPU, the scratch's on CUDA.
  float host_losses[2] = {0.0f, 0.0f};
  float* losses = d.dev == Device::kCpu ? host_losses : static_cast<float*>(f.losses.data);
  MOEKIT_RETURN_IF_ERROR(forward_tokens(x, weights, config, d, s, f, {}, losses, profile));
  const auto sizes = group_sizes(s.tokens_per_expert);
  MOEKIT_RETURN_IF_ERROR(forward_experts(weights, config, sizes, s, s.y_perm, f.exec, profile));
  MOEKIT_RETURN_IF_ERROR(forward_finish(x, weights, config, d, s, f, out.out, profile));
  for (auto [to, from] : {std::pair{out.aux_loss, &losses[0]}, std::pair{out.z_loss, &losses[1]}}) {
    if (to) MOEKIT_RETURN_IF_ERROR(detail::copy_2d(to, 0, from, 0, sizeof(float), 1, f.exec));
  }
  if (present(out.tokens_per_expert)) {
    MOEKIT_RETURN_IF_ERROR(detail::copy_2d(
        out.tokens_per_expert.data, out.tokens_per_expert.stride[0] * sizeof(int32_t),
        s.tokens_per_expert.data, sizeof(int32_t), sizeof(int32_t), d.E, f.exec));
  }
  return {};
}

Status moe_layer_backward(ConstTensorView x, const MoeLayerWeights& weights,
                          const MoeLayerConfig& config, std::span<const std::byte> saved_buf,
                          ConstTensorView d_out, float d_aux_loss, float d_z_loss,
                          std::span<std::byte> scratch_buf, TensorView d_x,
                          const MoeLayerWeightGrads& grads, MoeLayerProfile* profile,
                          const Exec& exec) {
  constexpr const char* op = "moe_layer_backward";
  Dims d;
  MOEKIT_RETURN_IF_ERROR(check_inputs(op, x, weights, config, d, 1, exec));
  MOEKIT_RETURN_IF_ERROR(check_backward_not_packed(op, config));
  MOEKIT_RETURN_IF_ERROR(
      check_backward_args(op, d, weights, d_out, d_aux_loss, d_z_loss, d_x, grads));
  const MoeLayerWorkspace need = workspace_of(d);
  MOEKIT_RETURN_IF_ERROR(check_workspace(op, "saved", saved_buf, need.saved_bytes, d.dev));
  MOEKIT_RETURN_IF_ERROR(check_workspace(op, "scratch", scratch_buf, need.backward_bytes, d.dev));
  MOEKIT_RETURN_IF_ERROR(
      check_backward_disjoint(op, x, weights, config, d_out, d_x, grads, saved_buf, scratch_buf));
  if (profile) *profile = {};

  // The saved buffer is only read here; the arena hands out mutable views of it.
  Arena saved_arena(const_cast<std::byte*>(saved_buf.data())), scratch_arena(scratch_buf.data());
  const Saved s = carve_saved(d, saved_arena);
  const BackwardScratch b = carve_backward(d, scratch_arena, exec);
  const auto sizes = group_sizes(s.tokens_per_expert);

  // d_y [N, H] and the routing weights' gradient [T, k].
  MOEKIT_RETURN_IF_ERROR(timed(profile, b.exec, MoeStep::kUnpermute, [&] {
    return unpermute_backward(d_out, s.y_perm, s.row_map, s.topk_weights, b.d_y_perm,
                              b.d_topk_weights, PermuteImpl::kAuto, b.exec);
  }));
  MOEKIT_RETURN_IF_ERROR(backward_experts(weights, config, sizes, s, b, grads, profile));
  return backward_tokens(x, weights, config, d, s, b, {}, d_out, d_aux_loss, d_z_loss, d_x,
                         {grads.router, grads.shared_in, grads.shared_out}, profile);
}

// ---------------------------------------------------------------------------------------------
// The layer over P ranks.

namespace {

// A 64-byte aligned buffer that grows on demand and keeps no contents across a growth.
class GrowingBuffer {
 public:
  std::byte* reserve(size_t bytes) {
    if (bytes > size_) {
      data_.reset(static_cast<std::byte*>(::operator new (bytes, std::align_val_t{kAlign})));
      size_ = bytes;
    }
    return data_.get();
  }
  std::byte* data() { return data_.get(); }
  size_t size() const { return size_; }

 private:
  struct Free {
    void operator()(std::byte* p) const { ::operator delete (p, std::align_val_t{kAlign}); }
  };
  std::unique_ptr<std::byte, Free> data_;
  size_t size_ = 0;
};

// FNV-1a over every field of the config: the ranks must run the same layer.
uint64_t config_fingerprint(const MoeLayerConfig& c) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](const void* p, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      h ^= static_cast<const unsigned char*>(p)[i];
      h *= 1099511628211ull;
    }
  };
  auto put = [&](auto v) { mix(&v, sizeof v); };
  put(c.hidden), put(c.ffn), put(c.num_experts), put(c.shared_ffn), put(c.align_size);
  put(static_cast<int>(c.activation)), put(c.capacity_factor), put(static_cast<int>(c.drop_policy));
  put(c.pad_to_capacity), put(c.aux_loss_coeff), put(c.aux_loss_sequences), put(c.z_loss_coeff);
  put(c.batch_invariant), put(c.expert_weights_transposed), put(c.expert_weights_packed);
  const RouteOptions& r = c.route;
  put(r.k), put(static_cast<int>(r.score)), put(r.pre_softmax), put(r.num_groups);
  put(r.group_topk), put(r.scaling_factor), put(r.expert_bias.size());
  mix(r.expert_bias.data(), r.expert_bias.size_bytes());
  return h;
}

int64_t bits_of(float v) { return std::bit_cast<int32_t>(v); }

}  // namespace

// The step's plan and the layer's memory, carved the same way by the forward and the backward:
// token side (sized by this rank's T) and expert side (sized by the rows it receives, R).
struct MoeLayerEpState::Impl {
  EpPlan plan;
  bool ready = false;  // a forward has filled the saved buffers
  int64_t tokens = 0, total_tokens = 0;
  DType dtype = DType::kF32;
  GrowingBuffer token_saved, expert_saved, token_scratch, expert_scratch;

  // The saved tensors for R received rows. The forward grows the buffers first (grow); the
  // token side's size does not depend on R, so its tensors keep their places, and contents,
  // when the forward lays the buffers out again once the plan has given R.
  Saved saved(const Dims& d, int64_t R, bool grow) {
    Arena tc(nullptr), ec(nullptr);
    Saved s;
    lay_out_saved(d, R, tc, ec, s);
    Arena t(grow ? token_saved.reserve(tc.used()) : token_saved.data()),
        e(grow ? expert_saved.reserve(ec.used()) : expert_saved.data());
    lay_out_saved(d, R, t, e, s);
    return s;
  }
  ForwardScratch forward_scratch(const Dims& d, int64_t R) {
    auto lay_out = [&](Arena& t, Arena& e) {
      ForwardScratch f = carve_forward(d, t);
      f.x_perm = t.take(d.dt, {d.N, d.H});
      f.y_rows = e.take(d.dt, {R, d.H});
      return f;
    };
    Arena tc(nullptr), ec(nullptr);
    lay_out(tc, ec);
    Arena t(token_scratch.reserve(tc.used())), e(expert_scratch.reserve(ec.used()));
    return lay_out(t, e);
  }
  BackwardScratch backward_scratch(const Dims& d, int64_t R, const MoeLayerWeightGrads& grads) {
    auto lay_out = [&](Arena& t, Arena& e) {
      BackwardScratch b;
      carve_token_backward(d, t, b);
      if (grads.router.dtype != DType::kF32) b.d_router_f32 = t.take(DType::kF32, {d.H, d.E});
      if (d.Fs > 0 && grads.shared_in.dtype != DType::kF32) {
        b.d_shared_in_f32 = t.take(DType::kF32, {d.H, d.Ws});
      }
      if (d.Fs > 0 && grads.shared_out.dtype != DType::kF32) {
        b.d_shared_out_f32 = t.take(DType::kF32, {d.Fs, d.H});
      }
      b.d_rows = e.take(d.dt, {R, d.H});
      carve_expert_backward(d, R, e, b);
      return b;
    };
    Arena tc(nullptr), ec(nullptr);
    lay_out(tc, ec);
    Arena t(token_scratch.reserve(tc.used())), e(expert_scratch.reserve(ec.used()));
    return lay_out(t, e);
  }

 private:
  static void lay_out_saved(const Dims& d, int64_t R, Arena& t, Arena& e, Saved& s) {
    carve_token_saved(d, t, s);
    s.y_perm = t.take(d.dt, {d.N, d.H});
    carve_shared_saved(d, t, s);
    carve_expert_saved(d, R, e, s);
  }
};

MoeLayerEpState::MoeLayerEpState() : impl(std::make_unique<Impl>()) {}
MoeLayerEpState::~MoeLayerEpState() = default;
MoeLayerEpState::MoeLayerEpState(MoeLayerEpState&&) noexcept = default;
MoeLayerEpState& MoeLayerEpState::operator=(MoeLayerEpState&&) noexcept = default;
const EpPlan& MoeLayerEpState::plan() const { return impl->plan; }
size_t MoeLayerEpState::bytes() const {
  return impl->token_saved.size() + impl->expert_saved.size() + impl->token_scratch.size() +
         impl->expert_scratch.size();
}

Status moe_layer_ep_forward(ConstTensorView x, const MoeLayerWeights& weights,
                            const MoeLayerConfig& config, Communicator& comm,
                            MoeLayerEpState* state, const MoeLayerOutputs& out,
                            MoeLayerProfile* profile) {
  constexpr const char* op = "moe_layer_ep_forward";
  Dims d{};
  Status local = [&]() -> Status {
    if (!state || !state->impl) {
      return Status::invalid_argument(op, "state", "null", "must point to a MoeLayerEpState");
    }
    MOEKIT_RETURN_IF_ERROR(check_inputs(op, x, weights, config, d, comm.size()));
    MOEKIT_RETURN_IF_ERROR(check_outputs(op, d, out));
    return check_forward_disjoint(op, x, weights, config, out, {}, {});
  }();
  const detail::AgreedValue values[] = {
      {"config (every field)", local.ok() ? static_cast<int64_t>(config_fingerprint(config)) : 0},
      {"x.dtype", local.ok() ? static_cast<int64_t>(d.dt) : 0, true}};
  MOEKIT_RETURN_IF_ERROR(detail::agree(comm, op, local, values));
  if (profile) *profile = {};
  MoeLayerEpState::Impl& st = *state->impl;
  st.ready = false;

  // The group's token count, for the losses.
  std::vector<int64_t> tokens(static_cast<size_t>(comm.size()));
  MOEKIT_RETURN_IF_ERROR(comm.all_gather(&d.T, tokens.data(), sizeof(int64_t)));
  const Group g{&comm, std::accumulate(tokens.begin(), tokens.end(), int64_t{0}), comm.size()};

  // The expert side (R rows) is laid out once the plan is known.
  Saved s = st.saved(d, 0, true);
  ForwardScratch f = st.forward_scratch(d, 0);
  float losses[2] = {0.0f, 0.0f};  // aux, z
  MOEKIT_RETURN_IF_ERROR(forward_tokens(x, weights, config, d, s, f, g, losses, profile));
  MOEKIT_RETURN_IF_ERROR(timed(profile, f.exec, MoeStep::kDispatch, [&]() -> Status {
    MOEKIT_RETURN_IF_ERROR(ep_plan(s.tokens_per_expert, comm, &st.plan));
    // Now the rows this rank receives are known: the expert side's buffers. The token side's
    // tensors keep their places (the same layout over the same, already large enough, buffers).
    s = st.saved(d, st.plan.recv_rows, true);
    f = st.forward_scratch(d, st.plan.recv_rows);
    return ep_dispatch(st.plan, f.x_perm, s.x_rows, comm);
  }));
  const std::span<const int32_t> sizes(st.plan.local_tokens_per_expert);
  MOEKIT_RETURN_IF_ERROR(forward_experts(weights, config, sizes, s, f.y_rows, f.exec, profile));
  MOEKIT_RETURN_IF_ERROR(timed(profile, f.exec, MoeStep::kCombine,
                               [&] { return ep_combine(st.plan, f.y_rows, s.y_perm, comm); }));
  MOEKIT_RETURN_IF_ERROR(forward_finish(x, weights, config, d, s, f, out.out, profile));
  if (out.aux_loss) *out.aux_loss = losses[0];
  if (out.z_loss) *out.z_loss = losses[1];
  if (present(out.tokens_per_expert)) {
    for (int64_t e = 0; e < d.E; ++e) {  // each fits int32: ep_plan checked
      static_cast<int32_t*>(out.tokens_per_expert.data)[e * out.tokens_per_expert.stride[0]] =
          static_cast<int32_t>(st.plan.global_tokens_per_expert[static_cast<size_t>(e)]);
    }
  }
  st.ready = true;
  st.tokens = d.T;
  st.total_tokens = g.total_tokens;
  st.dtype = d.dt;
  return {};
}

Status moe_layer_ep_backward(ConstTensorView x, const MoeLayerWeights& weights,
                             const MoeLayerConfig& config, Communicator& comm,
                             MoeLayerEpState* state, ConstTensorView d_out, float d_aux_loss,
                             float d_z_loss, TensorView d_x, const MoeLayerWeightGrads& grads,
                             MoeLayerProfile* profile) {
  constexpr const char* op = "moe_layer_ep_backward";
  Dims d{};
  Status local = [&]() -> Status {
    if (!state || !state->impl) {
      return Status::invalid_argument(op, "state", "null", "must point to a MoeLayerEpState");
    }
    MOEKIT_RETURN_IF_ERROR(check_inputs(op, x, weights, config, d, comm.size()));
    MOEKIT_RETURN_IF_ERROR(check_backward_not_packed(op, config));
    const MoeLayerEpState::Impl& st = *state->impl;
    if (!st.ready || st.tokens != d.T || st.dtype != d.dt || st.plan.rank != comm.rank() ||
        st.plan.num_ranks != comm.size()) {
      return Status::invalid_argument(
          op, "state", st.ready ? fmt::format("a forward of {} tokens", st.tokens) : "empty",
          fmt::format("holds no forward of these {} tokens on this group (call "
                      "moe_layer_ep_forward first)",
                      d.T));
    }
    MOEKIT_RETURN_IF_ERROR(
        check_backward_args(op, d, weights, d_out, d_aux_loss, d_z_loss, d_x, grads));
    return check_backward_disjoint(op, x, weights, config, d_out, d_x, grads, {}, {});
  }();
  const detail::AgreedValue values[] = {
      {"config (every field)", local.ok() ? static_cast<int64_t>(config_fingerprint(config)) : 0},
      {"x.dtype", local.ok() ? static_cast<int64_t>(d.dt) : 0, true},
      {"d_aux_loss (bits)", bits_of(d_aux_loss)},
      {"d_z_loss (bits)", bits_of(d_z_loss)}};
  MOEKIT_RETURN_IF_ERROR(detail::agree(comm, op, local, values));
  if (profile) *profile = {};
  MoeLayerEpState::Impl& st = *state->impl;
  const Group g{&comm, st.total_tokens, comm.size()};
  const Saved s = st.saved(d, st.plan.recv_rows, false);
  const BackwardScratch b = st.backward_scratch(d, st.plan.recv_rows, grads);
  const std::span<const int32_t> sizes(st.plan.local_tokens_per_expert);

  MOEKIT_RETURN_IF_ERROR(timed(profile, b.exec, MoeStep::kUnpermute, [&] {
    return unpermute_backward(d_out, s.y_perm, s.row_map, s.topk_weights, b.d_y_perm,
                              b.d_topk_weights);
  }));
  // Combine's backward is a dispatch: d_y to the experts' ranks.
  MOEKIT_RETURN_IF_ERROR(timed(profile, b.exec, MoeStep::kCombine,
                               [&] { return ep_dispatch(st.plan, b.d_y_perm, b.d_rows, comm); }));
  MOEKIT_RETURN_IF_ERROR(backward_experts(weights, config, sizes, s, b, grads, profile));
  // And dispatch's a combine: d_x of the rows back to their tokens' ranks, into d_x_perm.
  MOEKIT_RETURN_IF_ERROR(timed(profile, b.exec, MoeStep::kDispatch,
                               [&] { return ep_combine(st.plan, b.d_rows, b.d_y_perm, comm); }));
  const ReplicatedGrads replicated{b.d_router_f32.data ? b.d_router_f32 : grads.router,
                                   b.d_shared_in_f32.data ? b.d_shared_in_f32 : grads.shared_in,
                                   b.d_shared_out_f32.data ? b.d_shared_out_f32 : grads.shared_out};
  MOEKIT_RETURN_IF_ERROR(backward_tokens(x, weights, config, d, s, b, g, d_out, d_aux_loss,
                                         d_z_loss, d_x, replicated, profile));
  // The replicated weights' gradients: summed over the ranks in f32, then rounded once.
  auto reduce = [&](MoeStep step, const TensorView& f32, const TensorView& grad) {
    return timed(profile, b.exec, step, [&]() -> Status {
      MOEKIT_RETURN_IF_ERROR(comm.all_reduce_sum(f32.data, f32.numel(), DType::kF32));
      if (f32.data != grad.data) MOEKIT_RETURN_IF_ERROR(detail::convert_rows(f32, grad, b.exec));
      return Status();
    });
  };
  MOEKIT_RETURN_IF_ERROR(reduce(MoeStep::kRouterGemm, replicated.router, grads.router));
  if (d.Fs > 0) {
    MOEKIT_RETURN_IF_ERROR(reduce(MoeStep::kSharedExpert, replicated.shared_in, grads.shared_in));
    MOEKIT_RETURN_IF_ERROR(reduce(MoeStep::kSharedExpert, replicated.shared_out, grads.shared_out));
  }
  return {};
}

}  // namespace moekit
