// The XLA FFI handlers of the CPU kernels, and the C interface of libmoekit_jax.so through which
// moekit/jax/_ffi.py (ctypes) finds every handler of the library, the CUDA ones included. A plain
// shared library, not a Python extension: one build loads in any Python that runs the jaxlib it
// was built against, or a later one.
//
// Each handler turns the XLA buffers into moekit views, calls the C++ core, and returns its
// Status as an ffi::Error: the message names the argument and its value, and JAX raises it as a
// Python exception. Shapes and dtypes are checked in Python at trace time; the checks here catch
// what only the data can show (group sizes, offsets) and anything that slipped through.
#include <cstdint>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ffi_common.h"
#include "moekit/ep.h"
#include "moekit/layer.h"
#include "moekit/permute.h"
#include "moekit/ragged_dot.h"
#include "moekit/router.h"

namespace moekit::python {
namespace {

// The one float of a scalar f32 buffer (a loss, or its cotangent).
float scalar_of(ffi::Buffer<ffi::F32> b) { return b.typed_data()[0]; }

// out [m, n] = ragged_dot(lhs [m, K], rhs [E_loc, K, n]) over the local groups.
ffi::Error ragged_dot_fwd(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> sizes,
                          ffi::Buffer<ffi::S32> offset, ffi::Result<ffi::AnyBuffer> out,
                          bool batch_invariant) {
  return call_ragged(ragged_dot, {"lhs", "rhs", "out"}, lhs, rhs, sizes, offset, *out,
                     batch_invariant);
}

// d_lhs [m, K] = ragged_dot(d_out [m, n], rhs^T).
ffi::Error ragged_dot_dlhs(ffi::AnyBuffer d_out, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> sizes,
                           ffi::Buffer<ffi::S32> offset, ffi::Result<ffi::AnyBuffer> d_lhs,
                           bool batch_invariant) {
  return call_ragged(moekit::ragged_dot_dlhs, {"d_out", "rhs", "d_lhs"}, d_out, rhs, sizes, offset,
                     *d_lhs, batch_invariant);
}

// d_rhs [E_loc, K, n]: lhs[rows of j]^T @ d_out[rows of j] per local group.
ffi::Error ragged_dot_drhs(ffi::AnyBuffer lhs, ffi::AnyBuffer d_out, ffi::Buffer<ffi::S32> sizes,
                           ffi::Buffer<ffi::S32> offset, ffi::Result<ffi::AnyBuffer> d_rhs,
                           bool batch_invariant) {
  return call_ragged(moekit::ragged_dot_drhs, {"lhs", "d_out", "d_rhs"}, lhs, d_out, sizes, offset,
                     *d_rhs, batch_invariant);
}

// The CPU handlers: the arguments and result, then the mode.
auto cpu_binding() { return ragged_binding(ffi::Ffi::Bind()).Attr<bool>("batch_invariant"); }

XLA_FFI_DEFINE_HANDLER(kRaggedDotFwd, ragged_dot_fwd, cpu_binding());
XLA_FFI_DEFINE_HANDLER(kRaggedDotDlhs, ragged_dot_dlhs, cpu_binding());
XLA_FFI_DEFINE_HANDLER(kRaggedDotDrhs, ragged_dot_drhs, cpu_binding());

// ---------------------------------------------------------------------------------------------
// Router. Options arrive as attributes, decoded into these structs (registered below, outside the
// namespace); score is RouterScore's value.

struct RouteAttrs {
  int32_t k, score;
  bool pre_softmax;
  int32_t num_groups, group_topk;
  float scaling_factor;
};

RouteOptions route_options(const RouteAttrs& a, std::span<const float> bias) {
  RouteOptions o;
  o.k = a.k;
  o.score = static_cast<RouterScore>(a.score);
  o.pre_softmax = a.pre_softmax;
  o.num_groups = a.num_groups;
  o.group_topk = a.group_topk;
  o.scaling_factor = a.scaling_factor;
  o.expert_bias = bias;
  return o;
}

// probs [T, E], routing_map [T, E] bool, topk_indices [T, k] i32, topk_weights [T, k] =
// route(logits [T, E]); expert_bias [E] f32 or [0] (none).
ffi::Error route_fwd(ffi::AnyBuffer logits, ffi::Buffer<ffi::F32> bias,
                     ffi::Result<ffi::AnyBuffer> probs, ffi::Result<ffi::AnyBuffer> map,
                     ffi::Result<ffi::AnyBuffer> idx, ffi::Result<ffi::AnyBuffer> weights,
                     RouteAttrs a) {
  ConstTensorView x;
  RouteOutputs out;
  MOEKIT_FFI_TRY(view_of(logits, "logits", &x));
  MOEKIT_FFI_TRY(view_of(*probs, "probs", &out.probs));
  MOEKIT_FFI_TRY(view_of(*map, "routing_map", &out.routing_map));
  MOEKIT_FFI_TRY(view_of(*idx, "topk_indices", &out.topk_indices));
  MOEKIT_FFI_TRY(view_of(*weights, "topk_weights", &out.topk_weights));
  const std::span<const float> b(bias.typed_data(), bias.element_count());
  return to_error(route(x, route_options(a, b), out));
}

// d_logits [T, E] from the cotangents of probs [T, E] and topk_weights [T, k].
ffi::Error route_bwd(ffi::AnyBuffer logits, ffi::AnyBuffer idx, ffi::AnyBuffer d_probs,
                     ffi::AnyBuffer d_weights, ffi::Result<ffi::AnyBuffer> d_logits, RouteAttrs a) {
  ConstTensorView x, i, dp, dw;
  TensorView dx;
  MOEKIT_FFI_TRY(view_of(logits, "logits", &x));
  MOEKIT_FFI_TRY(view_of(idx, "topk_indices", &i));
  MOEKIT_FFI_TRY(view_of(d_probs, "d_probs", &dp));
  MOEKIT_FFI_TRY(view_of(d_weights, "d_topk_weights", &dw));
  MOEKIT_FFI_TRY(view_of(*d_logits, "d_logits", &dx));
  return to_error(route_backward(x, i, dp, dw, route_options(a, {}), dx));
}

struct AuxAttrs {
  int32_t k, score;
};

// scores [T, E] f32 and their routing_map [T, E] bool = aux_loss_scores(logits [T, E]).
ffi::Error aux_fwd(ffi::AnyBuffer logits, ffi::Result<ffi::AnyBuffer> scores,
                   ffi::Result<ffi::AnyBuffer> map, AuxAttrs a) {
  ConstTensorView x;
  TensorView q, m;
  MOEKIT_FFI_TRY(view_of(logits, "logits", &x));
  MOEKIT_FFI_TRY(view_of(*scores, "scores", &q));
  MOEKIT_FFI_TRY(view_of(*map, "routing_map", &m));
  return to_error(aux_loss_scores(x, a.k, static_cast<RouterScore>(a.score), q, m));
}

ffi::Error aux_bwd(ffi::AnyBuffer logits, ffi::AnyBuffer d_scores,
                   ffi::Result<ffi::AnyBuffer> d_logits, AuxAttrs a) {
  ConstTensorView x, dq;
  TensorView dx;
  MOEKIT_FFI_TRY(view_of(logits, "logits", &x));
  MOEKIT_FFI_TRY(view_of(d_scores, "d_scores", &dq));
  MOEKIT_FFI_TRY(view_of(*d_logits, "d_logits", &dx));
  return to_error(aux_loss_scores_backward(x, dq, static_cast<RouterScore>(a.score), dx));
}

struct BalanceAttrs {
  int32_t k;
  float coeff;
  int64_t total_tokens;
  bool per_sequence;  // tokens_per_expert [B, E]: the sequence-level loss
};

LoadBalancingOptions balance_options(const BalanceAttrs& a) {
  LoadBalancingOptions o;
  o.k = a.k;
  o.coeff = a.coeff;
  o.total_tokens = a.total_tokens;
  return o;
}

// loss [] f32 = load_balancing_loss(scores [T, E], tokens_per_expert [E] | [B, E]).
ffi::Error balance_fwd(ffi::AnyBuffer scores, ffi::AnyBuffer tpe,
                       ffi::Result<ffi::Buffer<ffi::F32>> loss, BalanceAttrs a) {
  ConstTensorView q, n;
  MOEKIT_FFI_TRY(view_of(scores, "scores", &q));
  MOEKIT_FFI_TRY(view_of(tpe, "tokens_per_expert", &n));
  const auto fn = a.per_sequence ? seq_load_balancing_loss : load_balancing_loss;
  return to_error(fn(q, n, balance_options(a), loss->typed_data()));
}

// d_scores [T, E] from the loss's cotangent d_loss [] f32.
ffi::Error balance_bwd(ffi::AnyBuffer tpe, ffi::Buffer<ffi::F32> d_loss,
                       ffi::Result<ffi::AnyBuffer> d_scores, BalanceAttrs a) {
  ConstTensorView n;
  TensorView dq;
  MOEKIT_FFI_TRY(view_of(tpe, "tokens_per_expert", &n));
  MOEKIT_FFI_TRY(view_of(*d_scores, "d_scores", &dq));
  const auto fn = a.per_sequence ? seq_load_balancing_loss_backward : load_balancing_loss_backward;
  return to_error(fn(n, balance_options(a), scalar_of(d_loss), dq));
}

// loss [] f32 = z_loss(logits [T, E]).
ffi::Error z_fwd(ffi::AnyBuffer logits, ffi::Result<ffi::Buffer<ffi::F32>> loss, float coeff) {
  ConstTensorView x;
  MOEKIT_FFI_TRY(view_of(logits, "logits", &x));
  return to_error(z_loss(x, coeff, loss->typed_data()));
}

ffi::Error z_bwd(ffi::AnyBuffer logits, ffi::Buffer<ffi::F32> d_loss,
                 ffi::Result<ffi::AnyBuffer> d_logits, float coeff) {
  ConstTensorView x;
  TensorView dx;
  MOEKIT_FFI_TRY(view_of(logits, "logits", &x));
  MOEKIT_FFI_TRY(view_of(*d_logits, "d_logits", &dx));
  return to_error(z_loss_backward(x, coeff, scalar_of(d_loss), dx));
}

// ---------------------------------------------------------------------------------------------
// Permutation. Optional tensors arrive as placeholders with has_* = false.

struct PermuteAttrs {
  int64_t align_size;
  double capacity_factor;
  int32_t drop_policy;  // DropPolicy's value
  bool pad_to_capacity;
  int32_t k;
  bool has_probs;
};

// x_perm [N_out, H], probs_perm [N_out], tokens_per_expert [E], row_map [2, T, S],
// pad_offsets [E] = permute(x [T, H], routing [T, k] i32 | [T, E] bool, probs [T, S]).
ffi::Error permute_fwd(ffi::AnyBuffer x, ffi::AnyBuffer routing, ffi::AnyBuffer probs,
                       ffi::Result<ffi::AnyBuffer> x_perm, ffi::Result<ffi::AnyBuffer> probs_perm,
                       ffi::Result<ffi::AnyBuffer> tpe, ffi::Result<ffi::AnyBuffer> row_map,
                       ffi::Result<ffi::AnyBuffer> pad_offsets, PermuteAttrs a) {
  ConstTensorView vx, vr, vp;
  PermuteOutputs out;
  MOEKIT_FFI_TRY(view_of(x, "x", &vx));
  MOEKIT_FFI_TRY(view_of(routing, "routing", &vr));
  MOEKIT_FFI_TRY(view_of(probs, "probs", &vp, a.has_probs));
  MOEKIT_FFI_TRY(view_of(*x_perm, "x_perm", &out.x));
  MOEKIT_FFI_TRY(view_of(*probs_perm, "probs_perm", &out.probs, a.has_probs));
  MOEKIT_FFI_TRY(view_of(*tpe, "tokens_per_expert", &out.tokens_per_expert));
  MOEKIT_FFI_TRY(view_of(*row_map, "row_map", &out.row_map));
  MOEKIT_FFI_TRY(view_of(*pad_offsets, "pad_offsets", &out.pad_offsets));
  PermuteOptions o;
  o.align_size = a.align_size;
  o.capacity_factor = a.capacity_factor;
  o.drop_policy = static_cast<DropPolicy>(a.drop_policy);
  o.pad_to_capacity = a.pad_to_capacity;
  o.k = a.k;
  return to_error(permute(vx, vr, vp, o, out));
}

// d_x [T, H] and d_probs [T, S] from d_x_perm [N_out, H] and d_probs_perm [N_out].
ffi::Error permute_bwd(ffi::AnyBuffer d_x_perm, ffi::AnyBuffer d_probs_perm, ffi::AnyBuffer row_map,
                       ffi::Result<ffi::AnyBuffer> d_x, ffi::Result<ffi::AnyBuffer> d_probs,
                       bool has_probs) {
  ConstTensorView dxp, dpp, rm;
  TensorView dx, dp;
  MOEKIT_FFI_TRY(view_of(d_x_perm, "d_x_perm", &dxp));
  MOEKIT_FFI_TRY(view_of(d_probs_perm, "d_probs_perm", &dpp, has_probs));
  MOEKIT_FFI_TRY(view_of(row_map, "row_map", &rm));
  MOEKIT_FFI_TRY(view_of(*d_x, "d_x", &dx));
  MOEKIT_FFI_TRY(view_of(*d_probs, "d_probs", &dp, has_probs));
  return to_error(permute_backward(dxp, dpp, rm, dx, dp));
}

// out [T, H] = unpermute(y_perm [N_out, H], row_map, merging_probs [T, S]).
ffi::Error unpermute_fwd(ffi::AnyBuffer y_perm, ffi::AnyBuffer row_map, ffi::AnyBuffer probs,
                         ffi::Result<ffi::AnyBuffer> out, bool has_probs) {
  ConstTensorView y, rm, w;
  TensorView o;
  MOEKIT_FFI_TRY(view_of(y_perm, "y_perm", &y));
  MOEKIT_FFI_TRY(view_of(row_map, "row_map", &rm));
  MOEKIT_FFI_TRY(view_of(probs, "merging_probs", &w, has_probs));
  MOEKIT_FFI_TRY(view_of(*out, "out", &o));
  return to_error(unpermute(y, rm, w, o));
}

// d_y_perm [N_out, H] and d_merging_probs [T, S] from d_out [T, H].
ffi::Error unpermute_bwd(ffi::AnyBuffer d_out, ffi::AnyBuffer y_perm, ffi::AnyBuffer row_map,
                         ffi::AnyBuffer probs, ffi::Result<ffi::AnyBuffer> d_y_perm,
                         ffi::Result<ffi::AnyBuffer> d_probs, bool has_probs) {
  ConstTensorView g, y, rm, w;
  TensorView dy, dw;
  MOEKIT_FFI_TRY(view_of(d_out, "d_out", &g));
  MOEKIT_FFI_TRY(view_of(y_perm, "y_perm", &y, has_probs));
  MOEKIT_FFI_TRY(view_of(row_map, "row_map", &rm));
  MOEKIT_FFI_TRY(view_of(probs, "merging_probs", &w, has_probs));
  MOEKIT_FFI_TRY(view_of(*d_y_perm, "d_y_perm", &dy));
  MOEKIT_FFI_TRY(view_of(*d_probs, "d_merging_probs", &dw, has_probs));
  return to_error(unpermute_backward(g, y, rm, w, dy, dw));
}

struct SortAttrs {
  bool inverse, has_probs;
};

// out [N, H] (and out_probs [N]) = x's chunks reordered by sorted_index.
ffi::Error sort_chunks(ffi::AnyBuffer x, ffi::AnyBuffer split_sizes, ffi::AnyBuffer sorted_index,
                       ffi::AnyBuffer probs, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> out_probs, SortAttrs a) {
  ConstTensorView vx, vs, vi, vp;
  TensorView o, op;
  MOEKIT_FFI_TRY(view_of(x, "x", &vx));
  MOEKIT_FFI_TRY(view_of(split_sizes, "split_sizes", &vs));
  MOEKIT_FFI_TRY(view_of(sorted_index, "sorted_index", &vi));
  MOEKIT_FFI_TRY(view_of(probs, "probs", &vp, a.has_probs));
  MOEKIT_FFI_TRY(view_of(*out, "out", &o));
  MOEKIT_FFI_TRY(view_of(*out_probs, "out_probs", &op, a.has_probs));
  return to_error(sort_chunks_by_index(vx, vs, vi, a.inverse, o, vp, op));
}

}  // namespace
}  // namespace moekit::python

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(moekit::python::RouteAttrs,
                                      xla::ffi::StructMember<int32_t>("k"),
                                      xla::ffi::StructMember<int32_t>("score"),
                                      xla::ffi::StructMember<bool>("pre_softmax"),
                                      xla::ffi::StructMember<int32_t>("num_groups"),
                                      xla::ffi::StructMember<int32_t>("group_topk"),
                                      xla::ffi::StructMember<float>("scaling_factor"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(moekit::python::AuxAttrs,
                                      xla::ffi::StructMember<int32_t>("k"),
                                      xla::ffi::StructMember<int32_t>("score"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(moekit::python::BalanceAttrs,
                                      xla::ffi::StructMember<int32_t>("k"),
                                      xla::ffi::StructMember<float>("coeff"),
                                      xla::ffi::StructMember<int64_t>("total_tokens"),
                                      xla::ffi::StructMember<bool>("per_sequence"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(moekit::python::PermuteAttrs,
                                      xla::ffi::StructMember<int64_t>("align_size"),
                                      xla::ffi::StructMember<double>("capacity_factor"),
                                      xla::ffi::StructMember<int32_t>("drop_policy"),
                                      xla::ffi::StructMember<bool>("pad_to_capacity"),
                                      xla::ffi::StructMember<int32_t>("k"),
                                      xla::ffi::StructMember<bool>("has_probs"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(moekit::python::SortAttrs,
                                      xla::ffi::StructMember<bool>("inverse"),
                                      xla::ffi::StructMember<bool>("has_probs"));

namespace moekit::python {
namespace {

using ffi::AnyBuffer;
using F32 = ffi::Buffer<ffi::F32>;

// The layouts around an exchange of fixed-size blocks (moekit/ep.h): each takes one tensor and
// the counts and writes the other tensor; `names` are the three's names in the errors.
using FixedLayoutCall = Status (*)(ConstTensorView, ConstTensorView, TensorView);
ffi::Error call_layout(FixedLayoutCall fn, const char* const (&names)[3], ffi::AnyBuffer in,
                       ffi::AnyBuffer counts, ffi::AnyBuffer out) {
  ConstTensorView vi, vc;
  TensorView vo;
  MOEKIT_FFI_TRY(view_of(in, names[0], &vi));
  MOEKIT_FFI_TRY(view_of(counts, names[1], &vc));
  MOEKIT_FFI_TRY(view_of(out, names[2], &vo));
  return to_error(fn(vi, vc, vo));
}

ffi::Error ep_pack_fwd(ffi::AnyBuffer x_perm, ffi::AnyBuffer tpe,
                       ffi::Result<ffi::AnyBuffer> send) {
  return call_layout(ep_pack, {"x_perm", "tokens_per_expert", "send"}, x_perm, tpe, *send);
}
ffi::Error ep_unpack_fwd(ffi::AnyBuffer send, ffi::AnyBuffer tpe,
                         ffi::Result<ffi::AnyBuffer> x_perm) {
  return call_layout(ep_unpack, {"send", "tokens_per_expert", "x_perm"}, send, tpe, *x_perm);
}
ffi::Error ep_regroup_fwd(ffi::AnyBuffer recv, ffi::AnyBuffer rtpe,
                          ffi::Result<ffi::AnyBuffer> x_local) {
  return call_layout(ep_regroup, {"recv", "recv_tokens_per_expert", "x_local"}, recv, rtpe,
                     *x_local);
}
ffi::Error ep_ungroup_fwd(ffi::AnyBuffer x_local, ffi::AnyBuffer rtpe,
                          ffi::Result<ffi::AnyBuffer> recv) {
  return call_layout(ep_ungroup, {"x_local", "recv_tokens_per_expert", "recv"}, x_local, rtpe,
                     *recv);
}

// The expert FFN's activation over the first `rows` rows of h (an int32 scalar): a buffer whose
// static shape is a worst case holds its routed rows first (ragged_dot's groups). The rest of
// the result is 0, as the activation of ragged_dot's zero rows would be.
ffi::Error activation_args(ffi::AnyBuffer h, ffi::Buffer<ffi::S32> rows, int32_t kind,
                           ConstTensorView* vh, int64_t* n, Activation* act) {
  MOEKIT_FFI_TRY(view_of(h, "h", vh));
  if (vh->rank != 2) return ffi::Error::InvalidArgument("activation: h must have rank 2");
  if (rows.element_count() != 1) {
    return ffi::Error::InvalidArgument("activation: rows must hold one value");
  }
  *n = rows.typed_data()[0];
  if (*n < 0 || *n > vh->shape[0]) {
    return ffi::Error::InvalidArgument(
        "activation: rows = " + std::to_string(*n) +
        ": must be in [0, h.shape[0] = " + std::to_string(vh->shape[0]) + "]");
  }
  if (kind < 0 || kind > static_cast<int32_t>(Activation::kRelu)) {
    return ffi::Error::InvalidArgument("activation: kind = " + std::to_string(kind));
  }
  *act = static_cast<Activation>(kind);
  vh->shape[0] = *n;
  return ffi::Error::Success();
}

// A result or cotangent of the activation has h's rows (then it is cut to the computed ones).
template <class View>
ffi::Error cut_to_rows(const char* name, int64_t h_rows, int64_t n, View* v) {
  if (v->rank < 1 || v->shape[0] != h_rows) {
    return ffi::Error::InvalidArgument(std::string("activation: ") + name +
                                       " must have h's rows, " + std::to_string(h_rows));
  }
  v->shape[0] = n;
  return ffi::Error::Success();
}

// a [N, F] = act(h [N, 2F | F]) on rows < rows.
ffi::Error activation_fwd(ffi::AnyBuffer h, ffi::Buffer<ffi::S32> rows,
                          ffi::Result<ffi::AnyBuffer> a, int32_t kind) {
  ConstTensorView vh;
  TensorView va;
  int64_t n = 0;
  Activation act{};
  MOEKIT_FFI_TRY(activation_args(h, rows, kind, &vh, &n, &act));
  MOEKIT_FFI_TRY(view_of(*a, "a", &va));
  MOEKIT_FFI_TRY(cut_to_rows("a", h.dimensions()[0], n, &va));
  MOEKIT_FFI_TRY(to_error(activation(vh, act, va)));
  zero_rows_from(*a, n);
  return ffi::Error::Success();
}

// d_h [N, 2F | F] = d_a * act'(h) on rows < rows.
ffi::Error activation_bwd(ffi::AnyBuffer h, ffi::AnyBuffer d_a, ffi::Buffer<ffi::S32> rows,
                          ffi::Result<ffi::AnyBuffer> d_h, int32_t kind) {
  ConstTensorView vh, vd;
  TensorView vg;
  int64_t n = 0;
  Activation act{};
  MOEKIT_FFI_TRY(activation_args(h, rows, kind, &vh, &n, &act));
  MOEKIT_FFI_TRY(view_of(d_a, "d_a", &vd));
  MOEKIT_FFI_TRY(view_of(*d_h, "d_h", &vg));
  MOEKIT_FFI_TRY(cut_to_rows("d_a", h.dimensions()[0], n, &vd));
  MOEKIT_FFI_TRY(cut_to_rows("d_h", h.dimensions()[0], n, &vg));
  MOEKIT_FFI_TRY(to_error(activation_backward(vh, vd, act, vg)));
  zero_rows_from(*d_h, n);
  return ffi::Error::Success();
}

// x of a wider integer type (int64, uint32, uint64: jax_enable_x64's sizes, offsets and
// indices) as int32, each value checked: one that does not fit is an error naming `name` (the
// attribute "what": the call and the argument), the index and the value, never a narrowed number
// computed as another input.
template <class T>
ffi::Error narrow_values(const T* x, size_t n, std::string_view name, int32_t* out) {
  for (size_t i = 0; i < n; ++i) {
    if (!std::in_range<int32_t>(x[i])) {
      return ffi::Error::InvalidArgument(std::string(name) + "[" + std::to_string(i) +
                                         "] = " + std::to_string(x[i]) +
                                         ": does not fit int32 (moekit's sizes, offsets and "
                                         "indices are int32)");
    }
    out[i] = static_cast<int32_t>(x[i]);
  }
  return ffi::Error::Success();
}

ffi::Error to_int32(ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::S32>> out,
                    std::string_view name) {
  if (x.element_count() != out->element_count()) {
    return ffi::Error::InvalidArgument(std::string(name) + ": result size differs");
  }
  const size_t n = x.element_count();
  int32_t* o = out->typed_data();
  switch (x.element_type()) {
    case ffi::DataType::S64:
      return narrow_values(static_cast<const int64_t*>(x.untyped_data()), n, name, o);
    case ffi::DataType::U32:
      return narrow_values(static_cast<const uint32_t*>(x.untyped_data()), n, name, o);
    case ffi::DataType::U64:
      return narrow_values(static_cast<const uint64_t*>(x.untyped_data()), n, name, o);
    default:
      return ffi::Error::InvalidArgument(std::string(name) + ": expected int64, uint32 or uint64");
  }
}

// Binding b followed by kArgs buffer arguments, then kRets buffer results, of any element type
// (the C++ calls check each dtype and name the argument). A Binding cannot be copied or moved
// outside XLA's code, only extended, so the recursion ends on the last extension.
template <size_t kArgs, size_t kRets, class Binding>
auto buffers(Binding&& b) {
  static_assert(kArgs + kRets > 0);
  if constexpr (kArgs == 0) {
    if constexpr (kRets == 1) {
      return std::move(b).template Ret<AnyBuffer>();
    } else {
      return buffers<0, kRets - 1>(std::move(b).template Ret<AnyBuffer>());
    }
  } else if constexpr (kArgs + kRets == 1) {
    return std::move(b).template Arg<AnyBuffer>();
  } else {
    return buffers<kArgs - 1, kRets>(std::move(b).template Arg<AnyBuffer>());
  }
}
template <size_t kArgs, size_t kRets>
auto buffers() {
  return buffers<kArgs, kRets>(ffi::Ffi::Bind());
}

// The losses' values and their cotangents are f32 scalars. (Bindings are parenthesized: the
// macro would split them at their template commas.)
XLA_FFI_DEFINE_HANDLER(
    kRouteFwd, route_fwd,
    (buffers<0, 4>(ffi::Ffi::Bind().Arg<AnyBuffer>().Arg<F32>()).Attrs<RouteAttrs>()));
XLA_FFI_DEFINE_HANDLER(kRouteBwd, route_bwd, (buffers<4, 1>().Attrs<RouteAttrs>()));
XLA_FFI_DEFINE_HANDLER(kAuxFwd, aux_fwd, (buffers<1, 2>().Attrs<AuxAttrs>()));
XLA_FFI_DEFINE_HANDLER(kAuxBwd, aux_bwd, (buffers<2, 1>().Attrs<AuxAttrs>()));
XLA_FFI_DEFINE_HANDLER(kBalanceFwd, balance_fwd,
                       (buffers<2, 0>().Ret<F32>().Attrs<BalanceAttrs>()));
XLA_FFI_DEFINE_HANDLER(kBalanceBwd, balance_bwd,
                       (buffers<0, 1>(buffers<1, 0>().Arg<F32>()).Attrs<BalanceAttrs>()));
XLA_FFI_DEFINE_HANDLER(kZFwd, z_fwd, (buffers<1, 0>().Ret<F32>().Attr<float>("coeff")));
XLA_FFI_DEFINE_HANDLER(kZBwd, z_bwd,
                       (buffers<0, 1>(buffers<1, 0>().Arg<F32>()).Attr<float>("coeff")));
XLA_FFI_DEFINE_HANDLER(kPermuteFwd, permute_fwd, (buffers<3, 5>().Attrs<PermuteAttrs>()));
XLA_FFI_DEFINE_HANDLER(kPermuteBwd, permute_bwd, (buffers<3, 2>().Attr<bool>("has_probs")));
XLA_FFI_DEFINE_HANDLER(kUnpermuteFwd, unpermute_fwd, (buffers<3, 1>().Attr<bool>("has_probs")));
XLA_FFI_DEFINE_HANDLER(kUnpermuteBwd, unpermute_bwd, (buffers<4, 2>().Attr<bool>("has_probs")));
XLA_FFI_DEFINE_HANDLER(kSortChunks, sort_chunks, (buffers<4, 2>().Attrs<SortAttrs>()));
XLA_FFI_DEFINE_HANDLER(
    kActivationFwd, activation_fwd,
    (ffi::Ffi::Bind().Arg<AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>().Ret<AnyBuffer>().Attr<int32_t>(
        "kind")));
XLA_FFI_DEFINE_HANDLER(kActivationBwd, activation_bwd,
                       (ffi::Ffi::Bind()
                            .Arg<AnyBuffer>()
                            .Arg<AnyBuffer>()
                            .Arg<ffi::Buffer<ffi::S32>>()
                            .Ret<AnyBuffer>()
                            .Attr<int32_t>("kind")));
XLA_FFI_DEFINE_HANDLER(
    kToInt32, to_int32,
    (ffi::Ffi::Bind().Arg<AnyBuffer>().Ret<ffi::Buffer<ffi::S32>>().Attr<std::string_view>(
        "what")));
XLA_FFI_DEFINE_HANDLER(kEpPack, ep_pack_fwd, (buffers<2, 1>()));
XLA_FFI_DEFINE_HANDLER(kEpUnpack, ep_unpack_fwd, (buffers<2, 1>()));
XLA_FFI_DEFINE_HANDLER(kEpRegroup, ep_regroup_fwd, (buffers<2, 1>()));
XLA_FFI_DEFINE_HANDLER(kEpUngroup, ep_ungroup_fwd, (buffers<2, 1>()));

}  // namespace

#if !MOEKIT_FFI_CUDA
std::span<const Target> cuda_targets() { return {}; }
#endif  // else in ffi_cuda.cpp

}  // namespace moekit::python

// ---------------------------------------------------------------------------------------------
// The library's C interface (moekit/jax/_ffi.py declares the same with ctypes).

#define MOEKIT_FFI_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using moekit::python::Target;

constexpr Target kCpuTargets[] = {
    {"moekit_ragged_dot_fwd", "cpu", moekit::python::kRaggedDotFwd},
    {"moekit_ragged_dot_dlhs", "cpu", moekit::python::kRaggedDotDlhs},
    {"moekit_ragged_dot_drhs", "cpu", moekit::python::kRaggedDotDrhs},
    {"moekit_route_fwd", "cpu", moekit::python::kRouteFwd},
    {"moekit_route_bwd", "cpu", moekit::python::kRouteBwd},
    {"moekit_aux_scores_fwd", "cpu", moekit::python::kAuxFwd},
    {"moekit_aux_scores_bwd", "cpu", moekit::python::kAuxBwd},
    {"moekit_load_balancing_loss_fwd", "cpu", moekit::python::kBalanceFwd},
    {"moekit_load_balancing_loss_bwd", "cpu", moekit::python::kBalanceBwd},
    {"moekit_z_loss_fwd", "cpu", moekit::python::kZFwd},
    {"moekit_z_loss_bwd", "cpu", moekit::python::kZBwd},
    {"moekit_permute_fwd", "cpu", moekit::python::kPermuteFwd},
    {"moekit_permute_bwd", "cpu", moekit::python::kPermuteBwd},
    {"moekit_unpermute_fwd", "cpu", moekit::python::kUnpermuteFwd},
    {"moekit_unpermute_bwd", "cpu", moekit::python::kUnpermuteBwd},
    {"moekit_sort_chunks_by_index", "cpu", moekit::python::kSortChunks},
    {"moekit_activation_fwd", "cpu", moekit::python::kActivationFwd},
    {"moekit_activation_bwd", "cpu", moekit::python::kActivationBwd},
    {"moekit_to_int32", "cpu", moekit::python::kToInt32},
    {"moekit_ep_pack", "cpu", moekit::python::kEpPack},
    {"moekit_ep_unpack", "cpu", moekit::python::kEpUnpack},
    {"moekit_ep_regroup", "cpu", moekit::python::kEpRegroup},
    {"moekit_ep_ungroup", "cpu", moekit::python::kEpUngroup},
};

}  // namespace

// Every handler of this build: the CPU ones, then the CUDA ones where built. Returns how many,
// and points *targets at them (static storage, never freed).
MOEKIT_FFI_EXPORT int64_t moekit_ffi_targets(const Target** targets) {
  static const std::vector<Target> all = [] {
    std::vector<Target> v(std::begin(kCpuTargets), std::end(kCpuTargets));
    const auto cuda = moekit::python::cuda_targets();
    v.insert(v.end(), cuda.begin(), cuda.end());
    return v;
  }();
  *targets = all.data();
  return static_cast<int64_t>(all.size());
}

// The jaxlib whose FFI headers the handlers were compiled against.
MOEKIT_FFI_EXPORT const char* moekit_ffi_built_with_jaxlib() { return MOEKIT_JAXLIB_VERSION; }

// Whether the CUDA handlers are built.
MOEKIT_FFI_EXPORT bool moekit_ffi_cuda_built() { return moekit::cuda_built(); }

// Bytes of the workspace result a CUDA ragged_dot handler takes for E_loc = num_local local
// groups on the current device (alignment slack included); 0 without CUDA or for num_local < 0.
MOEKIT_FFI_EXPORT int64_t moekit_ffi_cuda_workspace_bytes(int64_t num_local) {
  if (num_local < 0 || !moekit::cuda_built()) return 0;
  return static_cast<int64_t>(moekit::ragged_dot_workspace_size(moekit::Device::kCuda, num_local) +
                              moekit::python::kCudaWorkspaceAlign - 1);
}

// The rows permute needs at most for any routing: the static N_out of its outputs.
MOEKIT_FFI_EXPORT int64_t moekit_ffi_permute_max_rows(int64_t T, int64_t E, int32_t k,
                                                      int64_t align_size, double capacity_factor,
                                                      bool pad_to_capacity) {
  moekit::PermuteOptions o;
  o.align_size = align_size;
  o.capacity_factor = capacity_factor;
  o.pad_to_capacity = pad_to_capacity;
  return moekit::permute_max_rows(T, E, k, o);
}
