"""moekit's MoE layer as a Flax NNX module: `MoeLayer` holds the weights of `moekit.jax.moe_layer`
(and the expert bias of loss-free balancing) with partitioning metadata, so that a Flax model
swaps its MoE block in a line:

    from moekit.flax import MoeLayer
    self.moe = MoeLayer(hidden=2048, ffn=768, num_experts=128, k=8, aux_loss_coeff=1e-2,
                        rngs=rngs)
    ...
    out, aux = self.moe(x)  # x [..., H]; aux: moekit.jax.MoeAux (the losses and the counts)

Needs flax (``pip install moekit[flax]``).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from moekit.jax import MoeParams, moe_layer, update_expert_bias

__all__ = ["ExpertBias", "MoeLayer"]

_GATED = ("swiglu", "geglu")


class ExpertBias(nnx.Variable):
    """The expert bias of loss-free balancing ([E] float32): it chooses experts and is not
    trained by gradients (`nnx.grad` over `nnx.Param` leaves it out); `MoeLayer.update_bias`
    moves it."""


# Lecun normal for stacked expert weights [E, fan_in, fan_out] (or [E, fan_out, fan_in]
# transposed): each expert's matrix scaled by its own fan-in.
_EXPERTS_INIT = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2,
                                                  out_axis=-1, batch_axis=(0,))
_EXPERTS_INIT_T = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                    in_axis=-1, out_axis=-2, batch_axis=(0,))


class MoeLayer(nnx.Module):
    """The MoE layer of `moekit.jax.moe_layer` with its weights.

    Weights (param_dtype; partitioning metadata ``out_sharding`` in logical axis names, which
    `nnx.get_partition_spec` and Flax's logical axis rules read):
      router      [H, E]                      (embed_axis, None)
      w_in        [E, H, 2F] gated, [E, H, F]  (expert_axis, embed_axis, mlp_axis)
      w_out       [E, F, H]                   (expert_axis, mlp_axis, embed_axis)
      shared_in   [H, 2Fs | Fs]               (embed_axis, mlp_axis)   with shared_ffn > 0
      shared_out  [Fs, H]                     (mlp_axis, embed_axis)
      b_in        [E, 2F] | [E, F]            (expert_axis, mlp_axis)    with use_bias (zeros)
      b_out       [E, H]                      (expert_axis, embed_axis)
      expert_bias [E] float32, an `ExpertBias` (zeros), with use_expert_bias (sigmoid or
                  sqrtsoftplus routing)
    With expert_weights_transposed=True (an option passed on to moe_layer): w_in [E, 2F | F, H]
    (expert_axis, mlp_axis, embed_axis) and w_out [E, H, F] (expert_axis, embed_axis, mlp_axis),
    linear layers' [out, in].

    Args:
      hidden, ffn, num_experts, k: H, F (per expert), E and the experts per token.
      shared_ffn: the shared expert's width Fs (DeepSeek: shared experts * F); 0: none.
      activation_kind: "swiglu" (default), "geglu", "gelu" or "relu" (the gated ones fuse gate
        and up in w_in).
      use_bias: the expert FFNs' biases b_in and b_out (gpt-oss; MaxText's w0 / w1 / wo
        biases).
      use_expert_bias: hold an expert bias for loss-free balancing (needs score "sigmoid" or
        "sqrtsoftplus"), moved by `update_bias`.
      param_dtype: the weights' dtype; dtype: the computation's (None: x's). moe_layer runs in
        one dtype: the weights are cast to it (gradients flow through the cast).
      expert_axis, embed_axis, mlp_axis: the logical axis names of the metadata.
      rngs: `nnx.Rngs` for the initialisation (lecun normal, each expert by its own fan-in).
      **options: every other `moe_layer` keyword, fixed for the module: score, pre_softmax,
        num_groups, group_topk, scaling_factor, capacity_factor, drop_policy, align_size,
        aux_loss_coeff, aux_loss_per_sequence, z_loss_coeff, ep_axis, ep_exchange,
        batch_invariant, fused, expert_weights_transposed.

    Calling it: ``out, aux = layer(x)``, x ``[..., H]`` (``[B, S, H]``): moe_layer's results.
    With ep_axis (inside `jax.shard_map`) the module's w_in and w_out hold this device's
    experts: shard them over expert_axis.
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, k: int, *, shared_ffn: int = 0,
                 activation_kind: str = "swiglu", use_bias: bool = False,
                 use_expert_bias: bool = False,
                 param_dtype: Any = jnp.float32, dtype: Optional[Any] = None,
                 expert_axis: str = "expert", embed_axis: str = "embed", mlp_axis: str = "mlp",
                 rngs: nnx.Rngs, **options):
        if "expert_bias" in options or "activation" in options:
            raise TypeError("MoeLayer: expert_bias is the module's own (use_expert_bias=True); "
                            "the activation is activation_kind")
        H, F, E = hidden, ffn, num_experts
        width = 2 * F if activation_kind in _GATED else F
        lecun = nnx.initializers.lecun_normal()

        # Outside a mesh the names are metadata only (for nnx.get_partition_spec and logical
        # axis rules); in a mesh (jax.sharding.use_mesh) Flax shards each weight as it is made,
        # by the context's logical axis rules, as its own layers do.
        eager = None if not jax.sharding.get_abstract_mesh().empty else False

        def param(init, shape, names):
            return nnx.Param(init(rngs.params(), shape, param_dtype), out_sharding=names,
                             eager_sharding=eager)

        self.router = param(lecun, (H, E), (embed_axis, None))
        if options.get("expert_weights_transposed", False):  # [E, out, in]
            self.w_in = param(_EXPERTS_INIT_T, (E, width, H),
                              (expert_axis, mlp_axis, embed_axis))
            self.w_out = param(_EXPERTS_INIT_T, (E, H, F), (expert_axis, embed_axis, mlp_axis))
        else:
            self.w_in = param(_EXPERTS_INIT, (E, H, width), (expert_axis, embed_axis, mlp_axis))
            self.w_out = param(_EXPERTS_INIT, (E, F, H), (expert_axis, mlp_axis, embed_axis))
        shared_width = 2 * shared_ffn if activation_kind in _GATED else shared_ffn
        self.shared_in = (param(lecun, (H, shared_width), (embed_axis, mlp_axis))
                          if shared_ffn else None)
        self.shared_out = (param(lecun, (shared_ffn, H), (mlp_axis, embed_axis))
                           if shared_ffn else None)
        zeros = nnx.initializers.zeros_init()
        self.b_in = param(zeros, (E, width), (expert_axis, mlp_axis)) if use_bias else None
        self.b_out = param(zeros, (E, H), (expert_axis, embed_axis)) if use_bias else None
        self.expert_bias = (ExpertBias(jnp.zeros((E,), jnp.float32), out_sharding=(None,),
                                       eager_sharding=eager)
                            if use_expert_bias else None)
        self.k = k
        self.activation_kind = activation_kind
        self.dtype = dtype
        self.options = dict(options)

    def params(self, dtype) -> MoeParams:
        """The weights as moe_layer takes them, in `dtype`."""
        def value(p):
            return None if p is None else jnp.asarray(p[...], dtype)
        return MoeParams(value(self.router), value(self.w_in), value(self.w_out),
                         value(self.shared_in), value(self.shared_out), value(self.b_in),
                         value(self.b_out))

    def __call__(self, x):
        x = jnp.asarray(x)
        dtype = self.dtype or x.dtype
        bias = None if self.expert_bias is None else self.expert_bias[...]
        return moe_layer(x.astype(dtype), self.params(dtype), k=self.k,
                         activation_kind=self.activation_kind, expert_bias=bias, **self.options)

    def update_bias(self, tokens_per_expert, rate):
        """The loss-free balancing step on the module's expert bias (`update_expert_bias`):
        raise the bias of experts chosen less than the mean, lower the others. tokens_per_expert:
        ``[E]`` counts of the batch, e.g. the layer's ``aux.tokens_per_expert``."""
        if self.expert_bias is None:
            raise ValueError("MoeLayer.update_bias: the layer holds no expert bias "
                             "(use_expert_bias=False)")
        self.expert_bias[...] = update_expert_bias(
            self.expert_bias[...], jax.lax.stop_gradient(tokens_per_expert), rate)
