// The XLA FFI handlers of the CPU kernels, and the C interface of libmoekit_jax.so through which
// moekit/jax/_ffi.py (ctypes) finds every handler of the library, the CUDA ones included. A plain
// shared library, not a Python extension: one build loads in any Python that runs the jaxlib it
// was built against, or a later one.
//
// Each handler turns the XLA buffers into moekit views, calls the C++ core, and returns its
// Status as an ffi::Error: the message names the argument and its value, and JAX raises it as a
// Python exception. Shapes and dtypes are checked in Python at trace time; the checks here catch
// what only the data can show (group sizes, offsets) and anything that slipped through.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cpu_worker.h"
#include "ffi_common.h"
#include "ffi_layer.h"
#include "ffi_ops.h"
#include "moekit/ep.h"
#include "moekit/layer.h"
#include "moekit/permute.h"
#include "moekit/ragged_dot.h"
#include "moekit/router.h"

namespace moekit::python {
namespace {

// The one float of a scalar f32 buffer (a loss, or its cotangent).
float scalar_of(ffi::Buffer<ffi::F32> b) { return b.typed_data()[0]; }

// out [m, n] = ragged_dot(lhs [m, K], rhs [E_loc, K, n]) over the local groups (rhs
// [E_loc, n, K] with rhs_transposed, as every handler here).
ffi::Error ragged_dot_fwd(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> sizes,
                          ffi::Buffer<ffi::S32> offset, ffi::Result<ffi::AnyBuffer> out,
                          bool batch_invariant, bool rhs_transposed) {
  return call_ragged(ragged_dot, {"lhs", "rhs", "out"}, lhs, rhs, sizes, offset, *out,
                     {batch_invariant, rhs_transposed});
}

// out [m, n] = ragged_dot(lhs [m, K], packed) on weights in pack_ragged_rhs's layout
// ([E_loc, ceil(n / 32), 64 ceil(K / 2)] bf16; n is the result's): the forward only, for
// inference.
ffi::Error ragged_dot_fwd_packed(ffi::AnyBuffer lhs, ffi::AnyBuffer packed,
                                 ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::S32> offset,
                                 ffi::Result<ffi::AnyBuffer> out, bool batch_invariant) {
  return call_ragged(ragged_dot, {"lhs", "rhs", "out"}, lhs, packed, sizes, offset, *out,
                     {.batch_invariant = batch_invariant, .rhs_packed = true});
}

// d_lhs [m, K] = ragged_dot(d_out [m, n], rhs^T).
ffi::Error ragged_dot_dlhs(ffi::AnyBuffer d_out, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> sizes,
                           ffi::Buffer<ffi::S32> offset, ffi::Result<ffi::AnyBuffer> d_lhs,
                           bool batch_invariant, bool rhs_transposed) {
  return call_ragged(moekit::ragged_dot_dlhs, {"d_out", "rhs", "d_lhs"}, d_out, rhs, sizes, offset,
                     *d_lhs, {batch_invariant, rhs_transposed});
}

// d_rhs [E_loc, K, n] ([E_loc, n, K] transposed): lhs[rows of j]^T @ d_out[rows of j] per local
// group.
ffi::Error ragged_dot_drhs(ffi::AnyBuffer lhs, ffi::AnyBuffer d_out, ffi::Buffer<ffi::S32> sizes,
                           ffi::Buffer<ffi::S32> offset, ffi::Result<ffi::AnyBuffer> d_rhs,
                           bool batch_invariant, bool rhs_transposed) {
  return call_ragged(moekit::ragged_dot_drhs, {"lhs", "d_out", "d_rhs"}, lhs, d_out, sizes, offset,
                     *d_rhs, {batch_invariant, rhs_transposed});
}

// The CPU handlers: the arguments and result, then the mode.
auto cpu_binding() { return ragged_attrs(ragged_binding(ffi::Ffi::Bind())); }

XLA_FFI_DEFINE_HANDLER(kRaggedDotFwd, OnWorker<ragged_dot_fwd>::call, cpu_binding());
XLA_FFI_DEFINE_HANDLER(kRaggedDotFwdPacked, OnWorker<ragged_dot_fwd_packed>::call,
                       ragged_binding(ffi::Ffi::Bind()).Attr<bool>("batch_invariant"));
XLA_FFI_DEFINE_HANDLER(kRaggedDotDlhs, OnWorker<ragged_dot_dlhs>::call, cpu_binding());
XLA_FFI_DEFINE_HANDLER(kRaggedDotDrhs, OnWorker<ragged_dot_drhs>::call, cpu_binding());

// ---------------------------------------------------------------------------------------------
// The router, the permutation and the activation on the CPU: ffi_ops.h's bodies with the CPU's
// Exec, the losses' cotangents and the activation's row count read from their buffers.

constexpr Exec kCpu{};

ffi::Error route_fwd(AnyBuffer logits, F32 bias, Ret<AnyBuffer> probs, Ret<AnyBuffer> map,
                     Ret<AnyBuffer> idx, Ret<AnyBuffer> weights, RouteAttrs a) {
  return route_body(kCpu, logits, bias, *probs, *map, *idx, *weights, a);
}
ffi::Error route_bwd(AnyBuffer logits, AnyBuffer idx, AnyBuffer d_probs, AnyBuffer d_weights,
                     Ret<AnyBuffer> d_logits, RouteAttrs a) {
  return route_backward_body(kCpu, logits, idx, d_probs, d_weights, *d_logits, a);
}
ffi::Error aux_fwd(AnyBuffer logits, Ret<AnyBuffer> scores, Ret<AnyBuffer> map, AuxAttrs a) {
  return aux_body(kCpu, logits, *scores, *map, a);
}
ffi::Error aux_bwd(AnyBuffer logits, AnyBuffer d_scores, Ret<AnyBuffer> d_logits, AuxAttrs a) {
  return aux_backward_body(kCpu, logits, d_scores, *d_logits, a);
}
ffi::Error balance_fwd(AnyBuffer scores, AnyBuffer tpe, Ret<F32> loss, BalanceAttrs a) {
  return balance_body(kCpu, scores, tpe, *loss, a);
}
ffi::Error balance_bwd(AnyBuffer tpe, F32 d_loss, Ret<AnyBuffer> d_scores, BalanceAttrs a) {
  return balance_backward_body(kCpu, tpe, scalar_of(d_loss), *d_scores, a);
}
ffi::Error z_fwd(AnyBuffer logits, Ret<F32> loss, float coeff) {
  return z_body(kCpu, logits, *loss, coeff);
}
ffi::Error z_bwd(AnyBuffer logits, F32 d_loss, Ret<AnyBuffer> d_logits, float coeff) {
  return z_backward_body(kCpu, logits, scalar_of(d_loss), *d_logits, coeff);
}
ffi::Error count_fwd(AnyBuffer routing_map, Ret<AnyBuffer> counts) {
  return count_body(kCpu, routing_map, *counts);
}
ffi::Error bias_update(AnyBuffer tpe, AnyBuffer bias, Ret<AnyBuffer> out, float rate) {
  return bias_update_body(kCpu, tpe, bias, *out, rate);
}
ffi::Error permute_fwd(AnyBuffer x, AnyBuffer routing, AnyBuffer probs, Ret<AnyBuffer> x_perm,
                       Ret<AnyBuffer> probs_perm, Ret<AnyBuffer> tpe, Ret<AnyBuffer> row_map,
                       Ret<AnyBuffer> pad_offsets, PermuteAttrs a) {
  return permute_body(kCpu, x, routing, probs, *x_perm, *probs_perm, *tpe, *row_map, *pad_offsets,
                      a);
}
ffi::Error permute_bwd(AnyBuffer d_x_perm, AnyBuffer d_probs_perm, AnyBuffer row_map,
                       Ret<AnyBuffer> d_x, Ret<AnyBuffer> d_probs, bool has_probs) {
  return permute_backward_body(kCpu, d_x_perm, d_probs_perm, row_map, *d_x, *d_probs, has_probs);
}
ffi::Error unpermute_fwd(AnyBuffer y_perm, AnyBuffer row_map, AnyBuffer probs, Ret<AnyBuffer> out,
                         bool has_probs) {
  return unpermute_body(kCpu, y_perm, row_map, probs, *out, has_probs);
}
ffi::Error unpermute_bwd(AnyBuffer d_out, AnyBuffer y_perm, AnyBuffer row_map, AnyBuffer probs,
                         Ret<AnyBuffer> d_y_perm, Ret<AnyBuffer> d_probs, bool has_probs) {
  return unpermute_backward_body(kCpu, d_out, y_perm, row_map, probs, *d_y_perm, *d_probs,
                                 has_probs);
}
ffi::Error sort_chunks(AnyBuffer x, AnyBuffer split_sizes, AnyBuffer sorted_index, AnyBuffer probs,
                       Ret<AnyBuffer> out, Ret<AnyBuffer> out_probs, SortAttrs a) {
  return sort_chunks_body(kCpu, x, split_sizes, sorted_index, probs, *out, *out_probs, a);
}

// The activation's row count: one int32 in [0, h.shape[0]] (h of rank 2).
ffi::Error activation_rows(AnyBuffer h, ffi::Buffer<ffi::S32> rows, int64_t* n) {
  if (h.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("activation: h must have rank 2");
  if (rows.element_count() != 1) {
    return ffi::Error::InvalidArgument("activation: rows must hold one value");
  }
  *n = rows.typed_data()[0];
  if (*n < 0 || *n > h.dimensions()[0]) {
    return ffi::Error::InvalidArgument(
        "activation: rows = " + std::to_string(*n) +
        ": must be in [0, h.shape[0] = " + std::to_string(h.dimensions()[0]) + "]");
  }
  return ffi::Error::Success();
}

// a [N, F] = act(h [N, 2F | F]) on rows < rows; the rest of a is 0, as the activation of
// ragged_dot's zero rows past its groups would be.
ffi::Error activation_fwd(AnyBuffer h, ffi::Buffer<ffi::S32> rows, Ret<AnyBuffer> a, int32_t kind) {
  int64_t n = 0;
  MOEKIT_FFI_TRY(activation_rows(h, rows, &n));
  MOEKIT_FFI_TRY(activation_body(kCpu, h, n, *a, kind));
  zero_rows_from(*a, n);
  return ffi::Error::Success();
}

// d_h [N, 2F | F] = d_a * act'(h) on rows < rows, 0 past them.
ffi::Error activation_bwd(AnyBuffer h, AnyBuffer d_a, ffi::Buffer<ffi::S32> rows,
                          Ret<AnyBuffer> d_h, int32_t kind) {
  int64_t n = 0;
  MOEKIT_FFI_TRY(activation_rows(h, rows, &n));
  MOEKIT_FFI_TRY(activation_backward_body(kCpu, h, d_a, n, *d_h, kind));
  zero_rows_from(*d_h, n);
  return ffi::Error::Success();
}

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

// ---------------------------------------------------------------------------------------------
// The whole layer, one call each way (moekit/layer.h): moe_layer where nothing communicates
// between its steps. The forward's saved activations are a uint8 result, the backward's
// argument: the JAX residual.

// moe_layer_forward / backward put their buffers at 64-byte boundaries; XLA aligns less, so each
// buffer result holds kLayerAlign - 1 bytes of slack. The saved one starts with a header, the
// offset of its aligned data, so that the backward finds the data where the forward put it.
constexpr size_t kLayerAlign = 64;
constexpr size_t kSavedHeader = sizeof(uint64_t);

std::byte* align_up(std::byte* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  return p + ((kLayerAlign - a % kLayerAlign) % kLayerAlign);
}

// The aligned bytes of a scratch result.
std::span<std::byte> scratch_of(ffi::AnyBuffer b) {
  std::byte* base = static_cast<std::byte*>(b.untyped_data());
  std::byte* data = align_up(base);
  const size_t skipped = static_cast<size_t>(data - base);
  return {data, b.size_bytes() > skipped ? b.size_bytes() - skipped : 0};
}

// The forward's saved result: its header written, the aligned bytes after it.
std::span<std::byte> saved_for_writing(ffi::AnyBuffer b) {
  std::byte* base = static_cast<std::byte*>(b.untyped_data());
  if (b.size_bytes() < kSavedHeader) return {};
  std::byte* data = align_up(base + kSavedHeader);
  const uint64_t offset = static_cast<uint64_t>(data - base);
  std::memcpy(base, &offset, sizeof offset);
  return {data, b.size_bytes() > offset ? b.size_bytes() - offset : 0};
}

// The backward's saved argument: the data at the header's offset. XLA hands the forward's result
// back in place, so the data is aligned as it was written; should a copy ever have moved it to
// another alignment, it is copied once more, into `moved`, to an aligned place.
struct AlignedFree {
  void operator()(std::byte* p) const { ::operator delete (p, std::align_val_t{kLayerAlign}); }
};
using AlignedBytes = std::unique_ptr<std::byte, AlignedFree>;

ffi::Error saved_for_reading(ffi::AnyBuffer b, AlignedBytes& moved,
                             std::span<const std::byte>* out) {
  const auto* base = static_cast<const std::byte*>(b.untyped_data());
  uint64_t offset = 0;
  if (b.size_bytes() >= kSavedHeader) std::memcpy(&offset, base, sizeof offset);
  if (offset < kSavedHeader || offset >= kSavedHeader + kLayerAlign || offset > b.size_bytes()) {
    return ffi::Error::InvalidArgument(
        "moe_layer backward: saved is not a residual of moekit's moe_layer forward");
  }
  std::span<const std::byte> data(base + offset, b.size_bytes() - offset);
  if (reinterpret_cast<uintptr_t>(data.data()) % kLayerAlign != 0) {
    moved.reset(static_cast<std::byte*>(
        ::operator new (std::max<size_t>(data.size(), 1), std::align_val_t{kLayerAlign})));
    std::memcpy(moved.get(), data.data(), data.size());
    data = {moved.get(), data.size()};
  }
  *out = data;
  return ffi::Error::Success();
}

// The router's, x's and the weights' views; the shared expert's are absent (placeholders) when
// the config has none, and an expert bias where its placeholder is empty (a bias [E, n] has
// elements).
ffi::Error layer_inputs(AnyBuffer x, AnyBuffer router, AnyBuffer w_in, AnyBuffer w_out,
                        AnyBuffer shared_in, AnyBuffer shared_out, AnyBuffer b_in, AnyBuffer b_out,
                        const MoeLayerConfig& c, ConstTensorView* vx, MoeLayerWeights* w) {
  const bool shared = c.shared_ffn > 0;
  MOEKIT_FFI_TRY(view_of(x, "x", vx));
  MOEKIT_FFI_TRY(view_of(router, "router", &w->router));
  MOEKIT_FFI_TRY(view_of(w_in, "w_in", &w->w_in));
  MOEKIT_FFI_TRY(view_of(w_out, "w_out", &w->w_out));
  MOEKIT_FFI_TRY(view_of(shared_in, "shared_in", &w->shared_in, shared));
  MOEKIT_FFI_TRY(view_of(shared_out, "shared_out", &w->shared_out, shared));
  MOEKIT_FFI_TRY(view_of(b_in, "b_in", &w->b_in, b_in.element_count() > 0));
  return view_of(b_out, "b_out", &w->b_out, b_out.element_count() > 0);
}

ffi::Error layer_fwd(AnyBuffer x, AnyBuffer router, AnyBuffer w_in, AnyBuffer w_out,
                     AnyBuffer shared_in, AnyBuffer shared_out, AnyBuffer b_in, AnyBuffer b_out,
                     F32 bias, Ret<AnyBuffer> out, Ret<F32> aux_loss, Ret<F32> z_loss,
                     Ret<AnyBuffer> tokens_per_expert, Ret<AnyBuffer> saved, Ret<AnyBuffer> scratch,
                     LayerAttrs a) {
  const MoeLayerConfig c = layer_config(a, {bias.typed_data(), bias.element_count()});
  ConstTensorView vx;
  MoeLayerWeights w;
  MOEKIT_FFI_TRY(
      layer_inputs(x, router, w_in, w_out, shared_in, shared_out, b_in, b_out, c, &vx, &w));
  MoeLayerOutputs o;
  MOEKIT_FFI_TRY(view_of(*out, "out", &o.out));
  MOEKIT_FFI_TRY(view_of(*tokens_per_expert, "tokens_per_expert", &o.tokens_per_expert));
  o.aux_loss = aux_loss->typed_data();
  o.z_loss = z_loss->typed_data();
  return to_error(moe_layer_forward(vx, w, c, saved_for_writing(*saved), scratch_of(*scratch), o));
}

ffi::Error layer_bwd(AnyBuffer x, AnyBuffer router, AnyBuffer w_in, AnyBuffer w_out,
                     AnyBuffer shared_in, AnyBuffer shared_out, AnyBuffer b_in, AnyBuffer b_out,
                     F32 bias, AnyBuffer saved, AnyBuffer d_out, F32 d_aux_loss, F32 d_z_loss,
                     Ret<AnyBuffer> d_x, Ret<AnyBuffer> d_router, Ret<AnyBuffer> d_w_in,
                     Ret<AnyBuffer> d_w_out, Ret<AnyBuffer> d_shared_in,
                     Ret<AnyBuffer> d_shared_out, Ret<AnyBuffer> d_b_in, Ret<AnyBuffer> d_b_out,
                     Ret<AnyBuffer> scratch, LayerAttrs a) {
  const MoeLayerConfig c = layer_config(a, {bias.typed_data(), bias.element_count()});
  const bool shared = c.shared_ffn > 0;
  ConstTensorView vx, vd;
  MoeLayerWeights w;
  MOEKIT_FFI_TRY(
      layer_inputs(x, router, w_in, w_out, shared_in, shared_out, b_in, b_out, c, &vx, &w));
  MOEKIT_FFI_TRY(view_of(d_out, "d_out", &vd));
  TensorView vdx;
  MoeLayerWeightGrads g;
  MOEKIT_FFI_TRY(view_of(*d_x, "d_x", &vdx));
  MOEKIT_FFI_TRY(view_of(*d_router, "d_router", &g.router));
  MOEKIT_FFI_TRY(view_of(*d_w_in, "d_w_in", &g.w_in));
  MOEKIT_FFI_TRY(view_of(*d_w_out, "d_w_out", &g.w_out));
  MOEKIT_FFI_TRY(view_of(*d_shared_in, "d_shared_in", &g.shared_in, shared));
  MOEKIT_FFI_TRY(view_of(*d_shared_out, "d_shared_out", &g.shared_out, shared));
  MOEKIT_FFI_TRY(view_of(*d_b_in, "d_b_in", &g.b_in, b_in.element_count() > 0));
  MOEKIT_FFI_TRY(view_of(*d_b_out, "d_b_out", &g.b_out, b_out.element_count() > 0));
  AlignedBytes moved;
  std::span<const std::byte> s;
  MOEKIT_FFI_TRY(saved_for_reading(saved, moved, &s));
  return to_error(moe_layer_backward(vx, w, c, s, vd, scalar_of(d_aux_loss), scalar_of(d_z_loss),
                                     scratch_of(*scratch), vdx, g));
}

// The losses' values and their cotangents are f32 scalars. (Bindings are parenthesized: the
// macro would split them at their template commas.)
XLA_FFI_DEFINE_HANDLER(
    kRouteFwd, OnWorker<route_fwd>::call,
    (buffers<0, 4>(ffi::Ffi::Bind().Arg<AnyBuffer>().Arg<F32>()).Attrs<RouteAttrs>()));
XLA_FFI_DEFINE_HANDLER(kRouteBwd, OnWorker<route_bwd>::call, (buffers<4, 1>().Attrs<RouteAttrs>()));
XLA_FFI_DEFINE_HANDLER(kAuxFwd, OnWorker<aux_fwd>::call, (buffers<1, 2>().Attrs<AuxAttrs>()));
XLA_FFI_DEFINE_HANDLER(kAuxBwd, OnWorker<aux_bwd>::call, (buffers<2, 1>().Attrs<AuxAttrs>()));
XLA_FFI_DEFINE_HANDLER(kBalanceFwd, OnWorker<balance_fwd>::call,
                       (buffers<2, 0>().Ret<F32>().Attrs<BalanceAttrs>()));
XLA_FFI_DEFINE_HANDLER(kBalanceBwd, OnWorker<balance_bwd>::call,
                       (buffers<0, 1>(buffers<1, 0>().Arg<F32>()).Attrs<BalanceAttrs>()));
XLA_FFI_DEFINE_HANDLER(kZFwd, OnWorker<z_fwd>::call,
                       (buffers<1, 0>().Ret<F32>().Attr<float>("coeff")));
XLA_FFI_DEFINE_HANDLER(kZBwd, OnWorker<z_bwd>::call,
                       (buffers<0, 1>(buffers<1, 0>().Arg<F32>()).Attr<float>("coeff")));
XLA_FFI_DEFINE_HANDLER(kCountTokens, OnWorker<count_fwd>::call, (buffers<1, 1>()));
XLA_FFI_DEFINE_HANDLER(kBiasUpdate, OnWorker<bias_update>::call,
                       (buffers<2, 1>().Attr<float>("rate")));
XLA_FFI_DEFINE_HANDLER(kPermuteFwd, OnWorker<permute_fwd>::call,
                       (buffers<3, 5>().Attrs<PermuteAttrs>()));
XLA_FFI_DEFINE_HANDLER(kPermuteBwd, OnWorker<permute_bwd>::call,
                       (buffers<3, 2>().Attr<bool>("has_probs")));
XLA_FFI_DEFINE_HANDLER(kUnpermuteFwd, OnWorker<unpermute_fwd>::call,
                       (buffers<3, 1>().Attr<bool>("has_probs")));
XLA_FFI_DEFINE_HANDLER(kUnpermuteBwd, OnWorker<unpermute_bwd>::call,
                       (buffers<4, 2>().Attr<bool>("has_probs")));
XLA_FFI_DEFINE_HANDLER(kSortChunks, OnWorker<sort_chunks>::call,
                       (buffers<4, 2>().Attrs<SortAttrs>()));
XLA_FFI_DEFINE_HANDLER(
    kActivationFwd, OnWorker<activation_fwd>::call,
    (ffi::Ffi::Bind().Arg<AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>().Ret<AnyBuffer>().Attr<int32_t>(
        "kind")));
XLA_FFI_DEFINE_HANDLER(kActivationBwd, OnWorker<activation_bwd>::call,
                       (ffi::Ffi::Bind()
                            .Arg<AnyBuffer>()
                            .Arg<AnyBuffer>()
                            .Arg<ffi::Buffer<ffi::S32>>()
                            .Ret<AnyBuffer>()
                            .Attr<int32_t>("kind")));
XLA_FFI_DEFINE_HANDLER(
    kToInt32, OnWorker<to_int32>::call,
    (ffi::Ffi::Bind().Arg<AnyBuffer>().Ret<ffi::Buffer<ffi::S32>>().Attr<std::string_view>(
        "what")));
// x, the seven weights (router, w_in, w_out, shared_in, shared_out, b_in, b_out), expert_bias;
// forward: out, the two losses, tokens_per_expert, saved, scratch; backward: saved, d_out and
// the two losses' cotangents, then d_x, the seven weights' gradients and scratch.
XLA_FFI_DEFINE_HANDLER(
    kLayerFwd, OnWorker<layer_fwd>::call,
    (buffers<0, 3>(buffers<8, 0>().Arg<F32>().Ret<AnyBuffer>().Ret<F32>().Ret<F32>())
         .Attrs<LayerAttrs>()));
XLA_FFI_DEFINE_HANDLER(
    kLayerBwd, OnWorker<layer_bwd>::call,
    (buffers<0, 9>(buffers<2, 0>(buffers<8, 0>().Arg<F32>()).Arg<F32>().Arg<F32>())
         .Attrs<LayerAttrs>()));
XLA_FFI_DEFINE_HANDLER(kEpPack, OnWorker<ep_pack_fwd>::call, (buffers<2, 1>()));
XLA_FFI_DEFINE_HANDLER(kEpUnpack, OnWorker<ep_unpack_fwd>::call, (buffers<2, 1>()));
XLA_FFI_DEFINE_HANDLER(kEpRegroup, OnWorker<ep_regroup_fwd>::call, (buffers<2, 1>()));
XLA_FFI_DEFINE_HANDLER(kEpUngroup, OnWorker<ep_ungroup_fwd>::call, (buffers<2, 1>()));

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
    {"moekit_ragged_dot_fwd_packed", "cpu", moekit::python::kRaggedDotFwdPacked},
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
    {"moekit_count_tokens_per_expert", "cpu", moekit::python::kCountTokens},
    {"moekit_update_expert_bias", "cpu", moekit::python::kBiasUpdate},
    {"moekit_permute_fwd", "cpu", moekit::python::kPermuteFwd},
    {"moekit_permute_bwd", "cpu", moekit::python::kPermuteBwd},
    {"moekit_unpermute_fwd", "cpu", moekit::python::kUnpermuteFwd},
    {"moekit_unpermute_bwd", "cpu", moekit::python::kUnpermuteBwd},
    {"moekit_sort_chunks_by_index", "cpu", moekit::python::kSortChunks},
    {"moekit_activation_fwd", "cpu", moekit::python::kActivationFwd},
    {"moekit_activation_bwd", "cpu", moekit::python::kActivationBwd},
    {"moekit_layer_fwd", "cpu", moekit::python::kLayerFwd},
    {"moekit_layer_bwd", "cpu", moekit::python::kLayerBwd},
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

namespace {
// A workspace size with the alignment slack of kCudaWorkspaceAlign; -1 for SIZE_MAX (sizes no
// call accepts), 0 in a build without CUDA.
int64_t cuda_workspace_result(size_t bytes) {
  if (!moekit::cuda_built()) return 0;
  if (bytes > static_cast<size_t>(INT64_MAX) - moekit::python::kCudaWorkspaceAlign) return -1;
  return static_cast<int64_t>(bytes + moekit::python::kCudaWorkspaceAlign - 1);
}
}  // namespace

// Bytes of the workspace result of a CUDA router handler (the losses) for T tokens of E experts.
MOEKIT_FFI_EXPORT int64_t moekit_ffi_cuda_router_workspace_bytes(int64_t T, int64_t E) {
  return cuda_workspace_result(moekit::router_workspace_size(moekit::Device::kCuda, T, E));
}

// Bytes of the workspace result of a CUDA permutation handler for T tokens, S slots per token,
// E experts (C chunks for sort_chunks_by_index) and N rows of the permuted buffer.
MOEKIT_FFI_EXPORT int64_t moekit_ffi_cuda_permute_workspace_bytes(int64_t T, int64_t S, int64_t E,
                                                                  int64_t N) {
  return cuda_workspace_result(moekit::permute_workspace_size(moekit::Device::kCuda, T, S, E, N));
}

// The sizes of the layer calls' byte results for T tokens of x's dtype (bf16: bfloat16, else
// float32), slack and header included: bytes[0] the forward's saved (the residual), bytes[1] its
// scratch, bytes[2] the backward's scratch. False, and nothing written, for a config the layer
// refuses (its calls name the problem) or sizes past int64.
MOEKIT_FFI_EXPORT bool moekit_ffi_layer_workspace(const moekit::python::LayerAttrs* a,
                                                  int64_t tokens, bool bf16, int64_t bytes[3]) {
  using moekit::python::kLayerAlign;
  const moekit::MoeLayerWorkspace w =
      moekit::moe_layer_workspace(moekit::python::layer_config(*a, {}), tokens,
                                  bf16 ? moekit::DType::kBF16 : moekit::DType::kF32);
  if (w.saved_bytes == 0) return false;  // every valid config saves tokens_per_expert
  const size_t slack = kLayerAlign - 1;
  const size_t need[3] = {w.saved_bytes, w.forward_bytes, w.backward_bytes};
  const size_t extra[3] = {moekit::python::kSavedHeader + slack, slack, slack};
  int64_t out[3];
  for (int i = 0; i < 3; ++i) {
    size_t b;
    if (__builtin_add_overflow(need[i], extra[i], &b) || b > static_cast<size_t>(INT64_MAX)) {
      return false;
    }
    out[i] = static_cast<int64_t>(b);
  }
  std::copy(out, out + 3, bytes);
  return true;
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
