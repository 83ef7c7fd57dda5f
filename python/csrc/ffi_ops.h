// The router, permutation and activation handlers' bodies, written once for both platforms: each
// turns its XLA buffers into moekit views and calls the C++ op with the Exec it is given, the
// CPU's (ffi.cpp) or the CUDA device's, on XLA's stream with the workspace result
// (ffi_cuda.cpp). Only the bindings differ by platform, and two things the host cannot read on a
// GPU without waiting for it:
//   - a loss's cotangent: the CPU handlers read its f32 buffer; the CUDA ones take it as the
//     attribute d_loss (moekit/jax passes 1 and scales the result by the traced cotangent);
//   - the activation's row count: the CPU handlers read it and compute those rows only; the CUDA
//     ones compute every row (moekit/jax masks the rest where it must, see layer.py).
// The attributes arrive as the structs below (their decoding is registered at the end).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "ffi_common.h"
#include "moekit/activation.h"
#include "moekit/exec.h"
#include "moekit/permute.h"
#include "moekit/router.h"

namespace moekit::python {

using ffi::AnyBuffer;
using F32 = ffi::Buffer<ffi::F32>;
template <class T>
using Ret = ffi::Result<T>;

// ---------------------------------------------------------------------------------------------
// Router. score is RouterScore's value.

struct RouteAttrs {
  int32_t k, score;
  bool pre_softmax;
  int32_t num_groups, group_topk;
  float scaling_factor;
};

inline RouteOptions route_options(const RouteAttrs& a, std::span<const float> bias) {
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
inline ffi::Error route_body(const Exec& exec, AnyBuffer logits, F32 bias, AnyBuffer probs,
                             AnyBuffer map, AnyBuffer idx, AnyBuffer weights, RouteAttrs a) {
  ConstTensorView x;
  RouteOutputs out;
  MOEKIT_FFI_TRY(view_of(logits, "logits", &x));
  MOEKIT_FFI_TRY(view_of(probs, "probs", &out.probs));
  MOEKIT_FFI_TRY(view_of(map, "routing_map", &out.routing_map));
  MOEKIT_FFI_TRY(view_of(idx, "topk_indices", &out.topk_indices));
  MOEKIT_FFI_TRY(view_of(weights, "topk_weights", &out.topk_weights));
  const std::span<const float> b(bias.typed_data(), bias.element_count());
  return to_error(route(x, route_options(a, b), out, exec));
}

// d_logits [T, E] from the cotangents of probs [T, E] and topk_weights [T, k].
inline ffi::Error route_backward_body(const Exec& exec, AnyBuffer logits, AnyBuffer idx,
                                      AnyBuffer d_probs, AnyBuffer d_weights, AnyBuffer d_logits,
                                      RouteAttrs a) {
  ConstTensorView x, i, dp, dw;
  TensorView dx;
  MOEKIT_FFI_TRY(view_of(logits, "logits", &x));
  MOEKIT_FFI_TRY(view_of(idx, "topk_indices", &i));
  MOEKIT_FFI_TRY(view_of(d_probs, "d_probs", &dp));
  MOEKIT_FFI_TRY(view_of(d_weights, "d_topk_weights", &dw));
  MOEKIT_FFI_TRY(view_of(d_logits, "d_logits", &dx));
  return to_error(route_backward(x, i, dp, dw, route_options(a, {}), dx, exec));
}

struct AuxAttrs {
  int32_t k, score;
};

// scores [T, E] f32 and their routing_map [T, E] bool = aux_loss_scores(logits [T, E]).
inline ffi::Error aux_body(const Exec& exec, AnyBuffer logits, AnyBuffer scores, AnyBuffer map,
                           AuxAttrs a) {
  ConstTensorView x;
  TensorView q, m;
  MOEKIT_FFI_TRY(view_of(logits, "logits", &x));
  MOEKIT_FFI_TRY(view_of(scores, "scores", &q));
  MOEKIT_FFI_TRY(view_of(map, "routing_map", &m));
  return to_error(
      aux_loss_scores(x, a.k, static_cast<RouterScore>(a.score), q, m, RouterImpl::kAuto, exec));
}

inline ffi::Error aux_backward_body(const Exec& exec, AnyBuffer logits, AnyBuffer d_scores,
                                    AnyBuffer d_logits, AuxAttrs a) {
  ConstTensorView x, dq;
  TensorView dx;
  MOEKIT_FFI_TRY(view_of(logits, "logits", &x));
  MOEKIT_FFI_TRY(view_of(d_scores, "d_scores", &dq));
  MOEKIT_FFI_TRY(view_of(d_logits, "d_logits", &dx));
  return to_error(aux_loss_scores_backward(x, dq, static_cast<RouterScore>(a.score), dx,
                                           RouterImpl::kAuto, exec));
}

struct BalanceAttrs {
  int32_t k;
  float coeff;
  int64_t total_tokens;
  bool per_sequence;  // tokens_per_expert [B, E]: the sequence-level loss
};

inline LoadBalancingOptions balance_options(const BalanceAttrs& a) {
  LoadBalancingOptions o;
  o.k = a.k;
  o.coeff = a.coeff;
  o.total_tokens = a.total_tokens;
  return o;
}

// loss [] f32 = load_balancing_loss(scores [T, E], tokens_per_expert [E] | [B, E]).
inline ffi::Error balance_body(const Exec& exec, AnyBuffer scores, AnyBuffer tpe, F32 loss,
                               BalanceAttrs a) {
  ConstTensorView q, n;
  MOEKIT_FFI_TRY(view_of(scores, "scores", &q));
  MOEKIT_FFI_TRY(view_of(tpe, "tokens_per_expert", &n));
  const auto fn = a.per_sequence ? seq_load_balancing_loss : load_balancing_loss;
  return to_error(fn(q, n, balance_options(a), loss.typed_data(), exec));
}

// d_scores [T, E] from the loss's cotangent d_loss.
inline ffi::Error balance_backward_body(const Exec& exec, AnyBuffer tpe, float d_loss,
                                        AnyBuffer d_scores, BalanceAttrs a) {
  ConstTensorView n;
  TensorView dq;
  MOEKIT_FFI_TRY(view_of(tpe, "tokens_per_expert", &n));
  MOEKIT_FFI_TRY(view_of(d_scores, "d_scores", &dq));
  const auto fn = a.per_sequence ? seq_load_balancing_loss_backward : load_balancing_loss_backward;
  return to_error(fn(n, balance_options(a), d_loss, dq, exec));
}

// loss [] f32 = z_loss(logits [T, E]).
inline ffi::Error z_body(const Exec& exec, AnyBuffer logits, F32 loss, float coeff) {
  ConstTensorView x;
  MOEKIT_FFI_TRY(view_of(logits, "logits", &x));
  return to_error(z_loss(x, coeff, loss.typed_data(), exec));
}

// counts [E] | [B, E] i32: the tokens of each expert (of each of B sequences) in routing_map
// [T, E] bool.
inline ffi::Error count_body(const Exec& exec, AnyBuffer routing_map, AnyBuffer counts) {
  ConstTensorView m;
  TensorView c;
  MOEKIT_FFI_TRY(view_of(routing_map, "routing_map", &m));
  MOEKIT_FFI_TRY(view_of(counts, "counts", &c));
  return to_error(count_tokens_per_expert(m, c, exec));
}

// The loss-free balancing step on expert_bias [E] f32, in place: the result is the argument's
// buffer (JAX's input_output_aliases), which the handler checks rather than trusts.
inline ffi::Error bias_update_body(const Exec& exec, AnyBuffer tokens_per_expert, AnyBuffer bias_in,
                                   AnyBuffer bias_out, float rate) {
  if (bias_in.untyped_data() != bias_out.untyped_data()) {
    return ffi::Error::Internal(
        "update_expert_bias: the result is not the expert_bias argument's buffer (the call must "
        "alias them)");
  }
  ConstTensorView n;
  TensorView b;
  MOEKIT_FFI_TRY(view_of(tokens_per_expert, "tokens_per_expert", &n));
  MOEKIT_FFI_TRY(view_of(bias_out, "expert_bias", &b));
  return to_error(update_expert_bias(n, rate, b, exec));
}

inline ffi::Error z_backward_body(const Exec& exec, AnyBuffer logits, float d_loss,
                                  AnyBuffer d_logits, float coeff) {
  ConstTensorView x;
  TensorView dx;
  MOEKIT_FFI_TRY(view_of(logits, "logits", &x));
  MOEKIT_FFI_TRY(view_of(d_logits, "d_logits", &dx));
  return to_error(z_loss_backward(x, coeff, d_loss, dx, exec));
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
inline ffi::Error permute_body(const Exec& exec, AnyBuffer x, AnyBuffer routing, AnyBuffer probs,
                               AnyBuffer x_perm, AnyBuffer probs_perm, AnyBuffer tpe,
                               AnyBuffer row_map, AnyBuffer pad_offsets, PermuteAttrs a) {
  ConstTensorView vx, vr, vp;
  PermuteOutputs out;
  MOEKIT_FFI_TRY(view_of(x, "x", &vx));
  MOEKIT_FFI_TRY(view_of(routing, "routing", &vr));
  MOEKIT_FFI_TRY(view_of(probs, "probs", &vp, a.has_probs));
  MOEKIT_FFI_TRY(view_of(x_perm, "x_perm", &out.x));
  MOEKIT_FFI_TRY(view_of(probs_perm, "probs_perm", &out.probs, a.has_probs));
  MOEKIT_FFI_TRY(view_of(tpe, "tokens_per_expert", &out.tokens_per_expert));
  MOEKIT_FFI_TRY(view_of(row_map, "row_map", &out.row_map));
  MOEKIT_FFI_TRY(view_of(pad_offsets, "pad_offsets", &out.pad_offsets));
  PermuteOptions o;
  o.align_size = a.align_size;
  o.capacity_factor = a.capacity_factor;
  o.drop_policy = static_cast<DropPolicy>(a.drop_policy);
  o.pad_to_capacity = a.pad_to_capacity;
  o.k = a.k;
  return to_error(permute(vx, vr, vp, o, out, exec));
}

// d_x [T, H] and d_probs [T, S] from d_x_perm [N_out, H] and d_probs_perm [N_out].
inline ffi::Error permute_backward_body(const Exec& exec, AnyBuffer d_x_perm,
                                        AnyBuffer d_probs_perm, AnyBuffer row_map, AnyBuffer d_x,
                                        AnyBuffer d_probs, bool has_probs) {
  ConstTensorView dxp, dpp, rm;
  TensorView dx, dp;
  MOEKIT_FFI_TRY(view_of(d_x_perm, "d_x_perm", &dxp));
  MOEKIT_FFI_TRY(view_of(d_probs_perm, "d_probs_perm", &dpp, has_probs));
  MOEKIT_FFI_TRY(view_of(row_map, "row_map", &rm));
  MOEKIT_FFI_TRY(view_of(d_x, "d_x", &dx));
  MOEKIT_FFI_TRY(view_of(d_probs, "d_probs", &dp, has_probs));
  return to_error(permute_backward(dxp, dpp, rm, dx, dp, PermuteImpl::kAuto, exec));
}

// out [T, H] = unpermute(y_perm [N_out, H], row_map, merging_probs [T, S]).
inline ffi::Error unpermute_body(const Exec& exec, AnyBuffer y_perm, AnyBuffer row_map,
                                 AnyBuffer probs, AnyBuffer out, bool has_probs) {
  ConstTensorView y, rm, w;
  TensorView o;
  MOEKIT_FFI_TRY(view_of(y_perm, "y_perm", &y));
  MOEKIT_FFI_TRY(view_of(row_map, "row_map", &rm));
  MOEKIT_FFI_TRY(view_of(probs, "merging_probs", &w, has_probs));
  MOEKIT_FFI_TRY(view_of(out, "out", &o));
  return to_error(unpermute(y, rm, w, o, PermuteImpl::kAuto, exec));
}

// d_y_perm [N_out, H] and d_merging_probs [T, S] from d_out [T, H].
inline ffi::Error unpermute_backward_body(const Exec& exec, AnyBuffer d_out, AnyBuffer y_perm,
                                          AnyBuffer row_map, AnyBuffer probs, AnyBuffer d_y_perm,
                                          AnyBuffer d_probs, bool has_probs) {
  ConstTensorView g, y, rm, w;
  TensorView dy, dw;
  MOEKIT_FFI_TRY(view_of(d_out, "d_out", &g));
  MOEKIT_FFI_TRY(view_of(y_perm, "y_perm", &y, has_probs));
  MOEKIT_FFI_TRY(view_of(row_map, "row_map", &rm));
  MOEKIT_FFI_TRY(view_of(probs, "merging_probs", &w, has_probs));
  MOEKIT_FFI_TRY(view_of(d_y_perm, "d_y_perm", &dy));
  MOEKIT_FFI_TRY(view_of(d_probs, "d_merging_probs", &dw, has_probs));
  return to_error(unpermute_backward(g, y, rm, w, dy, dw, PermuteImpl::kAuto, exec));
}

struct SortAttrs {
  bool inverse, has_probs;
};

// out [N, H] (and out_probs [N]) = x's chunks reordered by sorted_index.
inline ffi::Error sort_chunks_body(const Exec& exec, AnyBuffer x, AnyBuffer split_sizes,
                                   AnyBuffer sorted_index, AnyBuffer probs, AnyBuffer out,
                                   AnyBuffer out_probs, SortAttrs a) {
  ConstTensorView vx, vs, vi, vp;
  TensorView o, op;
  MOEKIT_FFI_TRY(view_of(x, "x", &vx));
  MOEKIT_FFI_TRY(view_of(split_sizes, "split_sizes", &vs));
  MOEKIT_FFI_TRY(view_of(sorted_index, "sorted_index", &vi));
  MOEKIT_FFI_TRY(view_of(probs, "probs", &vp, a.has_probs));
  MOEKIT_FFI_TRY(view_of(out, "out", &o));
  MOEKIT_FFI_TRY(view_of(out_probs, "out_probs", &op, a.has_probs));
  return to_error(sort_chunks_by_index(vx, vs, vi, a.inverse, o, vp, op, PermuteImpl::kAuto, exec));
}

// ---------------------------------------------------------------------------------------------
// The expert FFN's activation over the first `rows` rows of h (all of them on CUDA).

inline ffi::Error activation_kind(int32_t kind, Activation* act) {
  if (kind < 0 || kind > static_cast<int32_t>(Activation::kRelu)) {
    return ffi::Error::InvalidArgument("activation: kind = " + std::to_string(kind));
  }
  *act = static_cast<Activation>(kind);
  return ffi::Error::Success();
}

// A view of an [N, ...] buffer cut to its first `rows` rows; `name` must have h's rows.
template <class View>
ffi::Error rows_view(AnyBuffer b, const char* name, int64_t h_rows, int64_t rows, View* v) {
  MOEKIT_FFI_TRY(view_of(b, name, v));
  if (v->rank < 1 || v->shape[0] != h_rows) {
    return ffi::Error::InvalidArgument(std::string("activation: ") + name +
                                       " must have h's rows, " + std::to_string(h_rows));
  }
  v->shape[0] = rows;
  return ffi::Error::Success();
}

// a [N, F] = act(h [N, 2F | F]) on rows < rows, rows in [0, N] (checked by the caller).
inline ffi::Error activation_body(const Exec& exec, AnyBuffer h, int64_t rows, AnyBuffer a,
                                  int32_t kind) {
  ConstTensorView vh;
  TensorView va;
  Activation act{};
  MOEKIT_FFI_TRY(activation_kind(kind, &act));
  const int64_t n = h.dimensions().size() == 2 ? h.dimensions()[0] : -1;
  if (n < 0) return ffi::Error::InvalidArgument("activation: h must have rank 2");
  MOEKIT_FFI_TRY(rows_view(h, "h", n, rows, &vh));
  MOEKIT_FFI_TRY(rows_view(a, "a", n, rows, &va));
  return to_error(activation(vh, act, va, ActivationImpl::kAuto, exec));
}

// d_h [N, 2F | F] = d_a * act'(h) on rows < rows.
inline ffi::Error activation_backward_body(const Exec& exec, AnyBuffer h, AnyBuffer d_a,
                                           int64_t rows, AnyBuffer d_h, int32_t kind) {
  ConstTensorView vh, vd;
  TensorView vg;
  Activation act{};
  MOEKIT_FFI_TRY(activation_kind(kind, &act));
  const int64_t n = h.dimensions().size() == 2 ? h.dimensions()[0] : -1;
  if (n < 0) return ffi::Error::InvalidArgument("activation: h must have rank 2");
  MOEKIT_FFI_TRY(rows_view(h, "h", n, rows, &vh));
  MOEKIT_FFI_TRY(rows_view(d_a, "d_a", n, rows, &vd));
  MOEKIT_FFI_TRY(rows_view(d_h, "d_h", n, rows, &vg));
  return to_error(activation_backward(vh, vd, act, vg, ActivationImpl::kAuto, exec));
}

// ---------------------------------------------------------------------------------------------
// Bindings.

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
