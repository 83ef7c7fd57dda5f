// The whole layer's configuration as its FFI handlers take it (one struct attribute, decoded by
// XLA) and as moekit/jax/_ffi.py passes it to moekit_ffi_layer_workspace (ctypes, the same
// fields in the same order): moe_layer's arguments, turned into a MoeLayerConfig in one place.
#pragma once

#include <cstdint>
#include <span>

#include "ffi_common.h"
#include "ffi_ops.h"
#include "moekit/layer.h"

namespace moekit::python {

struct LayerAttrs {
  int64_t hidden, ffn, num_experts, shared_ffn;
  // The routing, as RouteAttrs.
  int32_t k, score;
  bool pre_softmax;
  int32_t num_groups, group_topk;
  float scaling_factor;
  int32_t activation;  // moekit::Activation's value
  // Capacity and alignment, as PermuteAttrs (capacity_factor 0: dropless).
  double capacity_factor;
  int32_t drop_policy;
  int64_t align_size;
  float aux_loss_coeff;
  int32_t aux_loss_sequences;  // > 0: the per-sequence loss over this many sequences
  float z_loss_coeff;
  bool batch_invariant;
  bool expert_weights_transposed;  // w_in, w_out [E, out, in]
  bool expert_weights_packed;      // w_in, w_out in pack_ragged_rhs's layout (the forward)
};

inline MoeLayerConfig layer_config(const LayerAttrs& a, std::span<const float> expert_bias) {
  MoeLayerConfig c;
  c.hidden = a.hidden;
  c.ffn = a.ffn;
  c.num_experts = a.num_experts;
  c.shared_ffn = a.shared_ffn;
  c.route = route_options(
      {a.k, a.score, a.pre_softmax, a.num_groups, a.group_topk, a.scaling_factor}, expert_bias);
  c.activation = static_cast<Activation>(a.activation);
  c.capacity_factor = a.capacity_factor;
  c.drop_policy = static_cast<DropPolicy>(a.drop_policy);
  c.align_size = a.align_size;
  c.aux_loss_coeff = a.aux_loss_coeff;
  c.aux_loss_sequences = a.aux_loss_sequences;
  c.z_loss_coeff = a.z_loss_coeff;
  c.batch_invariant = a.batch_invariant;
  c.expert_weights_transposed = a.expert_weights_transposed;
  c.expert_weights_packed = a.expert_weights_packed;
  return c;
}

}  // namespace moekit::python

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    moekit::python::LayerAttrs, xla::ffi::StructMember<int64_t>("hidden"),
    xla::ffi::StructMember<int64_t>("ffn"), xla::ffi::StructMember<int64_t>("num_experts"),
    xla::ffi::StructMember<int64_t>("shared_ffn"), xla::ffi::StructMember<int32_t>("k"),
    xla::ffi::StructMember<int32_t>("score"), xla::ffi::StructMember<bool>("pre_softmax"),
    xla::ffi::StructMember<int32_t>("num_groups"), xla::ffi::StructMember<int32_t>("group_topk"),
    xla::ffi::StructMember<float>("scaling_factor"), xla::ffi::StructMember<int32_t>("activation"),
    xla::ffi::StructMember<double>("capacity_factor"),
    xla::ffi::StructMember<int32_t>("drop_policy"), xla::ffi::StructMember<int64_t>("align_size"),
    xla::ffi::StructMember<float>("aux_loss_coeff"),
    xla::ffi::StructMember<int32_t>("aux_loss_sequences"),
    xla::ffi::StructMember<float>("z_loss_coeff"), xla::ffi::StructMember<bool>("batch_invariant"),
    xla::ffi::StructMember<bool>("expert_weights_transposed"),
    xla::ffi::StructMember<bool>("expert_weights_packed"));
