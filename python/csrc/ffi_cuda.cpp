// The XLA FFI handlers for JAX's CUDA platform: ragged_dot, the router and its losses, the
// permutation and the activation, registered under the CPU handlers' names (moekit/jax/_ffi.py),
// so that one jax.ffi.ffi_call runs on whichever device holds the arrays. Every buffer is in
// device memory, group sizes, indices and counts included: a call reads none of them on the host
// and runs on the stream XLA gives it, so nothing here waits for the GPU. The router's,
// permutation's and activation's bodies are ffi_ops.h's, shared with the CPU handlers; two
// arguments differ from those (ffi_ops.h says why): a loss's cotangent is the attribute d_loss,
// and the activation takes no row count.
//
// A call that needs scratch takes its workspace as its last result, which XLA allocates with the
// call's other buffers and moekit/jax drops (sized at trace time:
// moekit_ffi_cuda_*workspace_bytes). A call therefore allocates nothing, and launches the same
// kernels with the same arguments for the same buffers: XLA may trace it into a CUDA graph
// (kCmdBufferCompatible). Memory from the FFI scratch allocator would not do: it is freed when the
// handler returns, while the graph would keep using it on every replay.
#include <cstddef>
#include <cstdint>
#include <span>

#include "ffi_common.h"
#include "ffi_ops.h"
#include "moekit/ragged_dot.h"

namespace moekit::python {

// BalanceAttrs and the loss's cotangent (XLA takes a handler's attributes as one dictionary or
// as separate ones, not both).
struct BalanceBackwardAttrs {
  int32_t k;
  float coeff;
  int64_t total_tokens;
  bool per_sequence;
  float d_loss;
};

}  // namespace moekit::python

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(moekit::python::BalanceBackwardAttrs,
                                      xla::ffi::StructMember<int32_t>("k"),
                                      xla::ffi::StructMember<float>("coeff"),
                                      xla::ffi::StructMember<int64_t>("total_tokens"),
                                      xla::ffi::StructMember<bool>("per_sequence"),
                                      xla::ffi::StructMember<float>("d_loss"));

namespace moekit::python {
namespace {

using Stream = CUstream_st*;  // cudaStream_t

// On the device, on XLA's stream, with the workspace result (when the call has one) from its
// first kCudaWorkspaceAlign-aligned byte on. The call checks that what is left is enough.
Exec exec_on(Stream stream) { return Exec{.device = Device::kCuda, .stream = stream}; }
Exec exec_on(Stream stream, ffi::AnyBuffer workspace) {
  const auto base = reinterpret_cast<uintptr_t>(workspace.untyped_data());
  const uintptr_t aligned =
      (base + kCudaWorkspaceAlign - 1) / kCudaWorkspaceAlign * kCudaWorkspaceAlign;
  const size_t skipped = aligned - base;
  return Exec{
      .device = Device::kCuda,
      .stream = stream,
      .workspace = reinterpret_cast<void*>(aligned),
      .workspace_bytes = workspace.size_bytes() > skipped ? workspace.size_bytes() - skipped : 0};
}

// out [m, n] = ragged_dot(lhs [m, K], rhs [E_loc, K, n]) over the local groups (rhs
// [E_loc, n, K] with rhs_transposed, as every handler here).
ffi::Error ragged_dot_fwd(Stream stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                          ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::S32> offset,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                          bool batch_invariant, bool rhs_transposed) {
  return call_ragged(ragged_dot, {"lhs", "rhs", "out"}, lhs, rhs, sizes, offset, *out,
                     {batch_invariant, rhs_transposed}, exec_on(stream, *workspace));
}

// d_lhs [m, K] = ragged_dot(d_out [m, n], rhs^T).
ffi::Error ragged_dot_dlhs(Stream stream, ffi::AnyBuffer d_out, ffi::AnyBuffer rhs,
                           ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::S32> offset,
                           ffi::Result<ffi::AnyBuffer> d_lhs, ffi::Result<ffi::AnyBuffer> workspace,
                           bool batch_invariant, bool rhs_transposed) {
  return call_ragged(moekit::ragged_dot_dlhs, {"d_out", "rhs", "d_lhs"}, d_out, rhs, sizes, offset,
                     *d_lhs, {batch_invariant, rhs_transposed}, exec_on(stream, *workspace));
}

// d_rhs [E_loc, K, n] ([E_loc, n, K] transposed): lhs[rows of j]^T @ d_out[rows of j] per local
// group, 0 for empty ones.
ffi::Error ragged_dot_drhs(Stream stream, ffi::AnyBuffer lhs, ffi::AnyBuffer d_out,
                           ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::S32> offset,
                           ffi::Result<ffi::AnyBuffer> d_rhs, ffi::Result<ffi::AnyBuffer> workspace,
                           bool batch_invariant, bool rhs_transposed) {
  return call_ragged(moekit::ragged_dot_drhs, {"lhs", "d_out", "d_rhs"}, lhs, d_out, sizes, offset,
                     *d_rhs, {batch_invariant, rhs_transposed}, exec_on(stream, *workspace));
}

// The stream, the CPU handlers' arguments and result, then the workspace.
auto cuda_binding() {
  return ragged_attrs(
      ragged_binding(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<Stream>>()).Ret<ffi::AnyBuffer>());
}

XLA_FFI_DEFINE_HANDLER(kRaggedDotFwd, ragged_dot_fwd, cuda_binding(),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kRaggedDotDlhs, ragged_dot_dlhs, cuda_binding(),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kRaggedDotDrhs, ragged_dot_drhs, cuda_binding(),
                       {ffi::Traits::kCmdBufferCompatible});

// ---------------------------------------------------------------------------------------------
// The router, the permutation and the activation: ffi_ops.h's bodies on the device. A handler
// with a workspace takes it as the result after its own.

using WS = Ret<AnyBuffer>;  // the workspace result

ffi::Error route_fwd(Stream s, AnyBuffer logits, F32 bias, Ret<AnyBuffer> probs, Ret<AnyBuffer> map,
                     Ret<AnyBuffer> idx, Ret<AnyBuffer> weights, RouteAttrs a) {
  return route_body(exec_on(s), logits, bias, *probs, *map, *idx, *weights, a);
}
ffi::Error route_bwd(Stream s, AnyBuffer logits, AnyBuffer idx, AnyBuffer d_probs,
                     AnyBuffer d_weights, Ret<AnyBuffer> d_logits, RouteAttrs a) {
  return route_backward_body(exec_on(s), logits, idx, d_probs, d_weights, *d_logits, a);
}
ffi::Error aux_fwd(Stream s, AnyBuffer logits, Ret<AnyBuffer> scores, Ret<AnyBuffer> map,
                   AuxAttrs a) {
  return aux_body(exec_on(s), logits, *scores, *map, a);
}
ffi::Error aux_bwd(Stream s, AnyBuffer logits, AnyBuffer d_scores, Ret<AnyBuffer> d_logits,
                   AuxAttrs a) {
  return aux_backward_body(exec_on(s), logits, d_scores, *d_logits, a);
}
ffi::Error balance_fwd(Stream s, AnyBuffer scores, AnyBuffer tpe, Ret<F32> loss, WS ws,
                       BalanceAttrs a) {
  return balance_body(exec_on(s, *ws), scores, tpe, *loss, a);
}
ffi::Error balance_bwd(Stream s, AnyBuffer tpe, Ret<AnyBuffer> d_scores, BalanceBackwardAttrs a) {
  return balance_backward_body(exec_on(s), tpe, a.d_loss, *d_scores,
                               {a.k, a.coeff, a.total_tokens, a.per_sequence});
}
ffi::Error z_fwd(Stream s, AnyBuffer logits, Ret<F32> loss, WS ws, float coeff) {
  return z_body(exec_on(s, *ws), logits, *loss, coeff);
}
ffi::Error z_bwd(Stream s, AnyBuffer logits, Ret<AnyBuffer> d_logits, float coeff, float d_loss) {
  return z_backward_body(exec_on(s), logits, d_loss, *d_logits, coeff);
}
ffi::Error count_fwd(Stream s, AnyBuffer routing_map, Ret<AnyBuffer> counts) {
  return count_body(exec_on(s), routing_map, *counts);
}
ffi::Error bias_update(Stream s, AnyBuffer tpe, AnyBuffer bias, Ret<AnyBuffer> out, float rate) {
  return bias_update_body(exec_on(s), tpe, bias, *out, rate);
}
ffi::Error permute_fwd(Stream s, AnyBuffer x, AnyBuffer routing, AnyBuffer probs,
                       Ret<AnyBuffer> x_perm, Ret<AnyBuffer> probs_perm, Ret<AnyBuffer> tpe,
                       Ret<AnyBuffer> row_map, Ret<AnyBuffer> pad_offsets, WS ws, PermuteAttrs a) {
  return permute_body(exec_on(s, *ws), x, routing, probs, *x_perm, *probs_perm, *tpe, *row_map,
                      *pad_offsets, a);
}
ffi::Error permute_bwd(Stream s, AnyBuffer d_x_perm, AnyBuffer d_probs_perm, AnyBuffer row_map,
                       Ret<AnyBuffer> d_x, Ret<AnyBuffer> d_probs, bool has_probs) {
  return permute_backward_body(exec_on(s), d_x_perm, d_probs_perm, row_map, *d_x, *d_probs,
                               has_probs);
}
ffi::Error unpermute_fwd(Stream s, AnyBuffer y_perm, AnyBuffer row_map, AnyBuffer probs,
                         Ret<AnyBuffer> out, bool has_probs) {
  return unpermute_body(exec_on(s), y_perm, row_map, probs, *out, has_probs);
}
ffi::Error unpermute_bwd(Stream s, AnyBuffer d_out, AnyBuffer y_perm, AnyBuffer row_map,
                         AnyBuffer probs, Ret<AnyBuffer> d_y_perm, Ret<AnyBuffer> d_probs, WS ws,
                         bool has_probs) {
  return unpermute_backward_body(exec_on(s, *ws), d_out, y_perm, row_map, probs, *d_y_perm,
                                 *d_probs, has_probs);
}
ffi::Error sort_chunks(Stream s, AnyBuffer x, AnyBuffer split_sizes, AnyBuffer sorted_index,
                       AnyBuffer probs, Ret<AnyBuffer> out, Ret<AnyBuffer> out_probs, WS ws,
                       SortAttrs a) {
  return sort_chunks_body(exec_on(s, *ws), x, split_sizes, sorted_index, probs, *out, *out_probs,
                          a);
}
// Every row of h (a rank other than 2 is named by the body).
int64_t all_rows(AnyBuffer h) { return h.dimensions().size() == 2 ? h.dimensions()[0] : 0; }
ffi::Error activation_fwd(Stream s, AnyBuffer h, Ret<AnyBuffer> a, int32_t kind) {
  return activation_body(exec_on(s), h, all_rows(h), *a, kind);
}
ffi::Error activation_bwd(Stream s, AnyBuffer h, AnyBuffer d_a, Ret<AnyBuffer> d_h, int32_t kind) {
  return activation_backward_body(exec_on(s), h, d_a, all_rows(h), *d_h, kind);
}

// The stream, then kArgs buffer arguments and kRets buffer results (the workspace among them).
template <size_t kArgs, size_t kRets>
auto on_stream() {
  return buffers<kArgs, kRets>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<Stream>>());
}
constexpr auto kGraph = {ffi::Traits::kCmdBufferCompatible};

// (Bindings are parenthesized: the macro would split them at their template commas.)
XLA_FFI_DEFINE_HANDLER(
    kRouteFwd, route_fwd,
    (buffers<0, 4>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<Stream>>().Arg<AnyBuffer>().Arg<F32>())
         .Attrs<RouteAttrs>()),
    kGraph);
XLA_FFI_DEFINE_HANDLER(kRouteBwd, route_bwd, (on_stream<4, 1>().Attrs<RouteAttrs>()), kGraph);
XLA_FFI_DEFINE_HANDLER(kAuxFwd, aux_fwd, (on_stream<1, 2>().Attrs<AuxAttrs>()), kGraph);
XLA_FFI_DEFINE_HANDLER(kAuxBwd, aux_bwd, (on_stream<2, 1>().Attrs<AuxAttrs>()), kGraph);
XLA_FFI_DEFINE_HANDLER(kBalanceFwd, balance_fwd,
                       (on_stream<2, 0>().Ret<F32>().Ret<AnyBuffer>().Attrs<BalanceAttrs>()),
                       kGraph);
XLA_FFI_DEFINE_HANDLER(kBalanceBwd, balance_bwd, (on_stream<1, 1>().Attrs<BalanceBackwardAttrs>()),
                       kGraph);
XLA_FFI_DEFINE_HANDLER(kZFwd, z_fwd,
                       (on_stream<1, 0>().Ret<F32>().Ret<AnyBuffer>().Attr<float>("coeff")),
                       kGraph);
XLA_FFI_DEFINE_HANDLER(kZBwd, z_bwd, (on_stream<1, 1>().Attr<float>("coeff").Attr<float>("d_loss")),
                       kGraph);
XLA_FFI_DEFINE_HANDLER(kCountTokens, count_fwd, (on_stream<1, 1>()), kGraph);
XLA_FFI_DEFINE_HANDLER(kBiasUpdate, bias_update, (on_stream<2, 1>().Attr<float>("rate")), kGraph);
XLA_FFI_DEFINE_HANDLER(kPermuteFwd, permute_fwd, (on_stream<3, 6>().Attrs<PermuteAttrs>()), kGraph);
XLA_FFI_DEFINE_HANDLER(kPermuteBwd, permute_bwd, (on_stream<3, 2>().Attr<bool>("has_probs")),
                       kGraph);
XLA_FFI_DEFINE_HANDLER(kUnpermuteFwd, unpermute_fwd, (on_stream<3, 1>().Attr<bool>("has_probs")),
                       kGraph);
XLA_FFI_DEFINE_HANDLER(kUnpermuteBwd, unpermute_bwd, (on_stream<4, 3>().Attr<bool>("has_probs")),
                       kGraph);
XLA_FFI_DEFINE_HANDLER(kSortChunks, sort_chunks, (on_stream<4, 3>().Attrs<SortAttrs>()), kGraph);
XLA_FFI_DEFINE_HANDLER(kActivationFwd, activation_fwd, (on_stream<1, 1>().Attr<int32_t>("kind")),
                       kGraph);
XLA_FFI_DEFINE_HANDLER(kActivationBwd, activation_bwd, (on_stream<2, 1>().Attr<int32_t>("kind")),
                       kGraph);

constexpr Target kTargets[] = {
    {"moekit_ragged_dot_fwd", "CUDA", kRaggedDotFwd},
    {"moekit_ragged_dot_dlhs", "CUDA", kRaggedDotDlhs},
    {"moekit_ragged_dot_drhs", "CUDA", kRaggedDotDrhs},
    {"moekit_route_fwd", "CUDA", kRouteFwd},
    {"moekit_route_bwd", "CUDA", kRouteBwd},
    {"moekit_aux_scores_fwd", "CUDA", kAuxFwd},
    {"moekit_aux_scores_bwd", "CUDA", kAuxBwd},
    {"moekit_load_balancing_loss_fwd", "CUDA", kBalanceFwd},
    {"moekit_load_balancing_loss_bwd", "CUDA", kBalanceBwd},
    {"moekit_z_loss_fwd", "CUDA", kZFwd},
    {"moekit_z_loss_bwd", "CUDA", kZBwd},
    {"moekit_count_tokens_per_expert", "CUDA", kCountTokens},
    {"moekit_update_expert_bias", "CUDA", kBiasUpdate},
    {"moekit_permute_fwd", "CUDA", kPermuteFwd},
    {"moekit_permute_bwd", "CUDA", kPermuteBwd},
    {"moekit_unpermute_fwd", "CUDA", kUnpermuteFwd},
    {"moekit_unpermute_bwd", "CUDA", kUnpermuteBwd},
    {"moekit_sort_chunks_by_index", "CUDA", kSortChunks},
    {"moekit_activation_fwd", "CUDA", kActivationFwd},
    {"moekit_activation_bwd", "CUDA", kActivationBwd},
};

}  // namespace

std::span<const Target> cuda_targets() { return kTargets; }

}  // namespace moekit::python
