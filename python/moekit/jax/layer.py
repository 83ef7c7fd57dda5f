"""moe_layer: the MoE layer (SPEC.md section 5) built from the moekit JAX steps."""

from __future__ import annotations

import collections.abc
import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from moekit.jax import _ffi, ep, ep_mpi
from moekit.jax import _token_sharding as ts
from moekit.jax.permute import capacity_options, permute, unpermute
from moekit.jax.ragged_dot import PackedRhs, _ragged_rows, ragged_dot
from moekit.jax.router import aux_loss_scores, load_balancing_loss, route, route_attrs, z_loss

__all__ = ["MoeAux", "MoeParams", "activation", "moe_layer"]


class MoeParams(NamedTuple):
    """The layer's weights, all in x's dtype. Gated activations fuse gate and up in w_in. The
    expert FFNs' biases (gpt-oss; MaxText's w0 / w1 / wo biases) are optional, each on its own:
    h = x @ w_in[e] + b_in[e], y = a @ w_out[e] + b_out[e] on the rows of expert e (the matmul
    rounded to x's dtype, the bias added in float32 and the sum rounded again). With
    moe_layer's expert_weights_transposed, w_in is [E, 2F | F, H] and w_out [E, H, F]: each
    expert's weights as linear layers' [out, in]."""
    router: jax.Array                       # [H, E]
    w_in: jax.Array                         # [E, H, 2F] (gate | up) gated, [E, H, F] otherwise
    w_out: jax.Array                        # [E, F, H]
    shared_in: Optional[jax.Array] = None   # [H, 2Fs] | [H, Fs]: the shared expert, or None
    shared_out: Optional[jax.Array] = None  # [Fs, H]
    b_in: Optional[jax.Array] = None        # [E, 2F] | [E, F]: the experts' first bias, or None
    b_out: Optional[jax.Array] = None       # [E, H]


class MoeAux(NamedTuple):
    """What the layer returns beside its output."""
    aux_loss: jax.Array           # float32 scalar: the load-balancing loss (0 when its coeff is 0)
    z_loss: jax.Array             # float32 scalar: the z-loss (0 when its coeff is 0)
    tokens_per_expert: jax.Array  # [E] int32: rows of each expert's block, as permute made them


# kind: (gated, moekit::Activation's value)
_ACTIVATIONS = {"swiglu": (True, 0), "geglu": (True, 1), "gelu": (False, 2), "relu": (False, 3)}
# moe_layer's ep_exchange: (dispatch, combine) of each ("auto" picks one of them).
_EXCHANGES = {"auto": None, "all_to_all": (ep.dispatch, ep.combine),
              "ragged": (ep.dispatch_ragged, ep.combine_ragged),
              "mpi": (ep_mpi.dispatch, ep_mpi.combine)}


def activation(h, kind="swiglu", *, rows=None):
    """The expert FFN's nonlinearity, in float32, rounded once to h's dtype (moekit's C++ kernel,
    forward and backward).

    Gated ("swiglu": silu(gate) * up, "geglu": gelu(gate) * up) take h = [gate | up] ``[N, 2F]``
    and give ``[N, F]``; "gelu" (the tanh form, as jax.nn.gelu's default) and "relu" map
    ``[N, F]``. rows: None (every row), or an int32 scalar, traced or not: only rows below it
    are computed and the rest of the result is 0 (for a buffer whose static shape is a worst
    case, such as ragged_dot's output past its groups, whose rows are 0 and map to 0). A rows
    outside [0, N] raises when the result is computed on the CPU; on a GPU, where the kernel
    computes every row (the count is on the device), the rows from `rows` on are set to 0 after.
    Under `jit` with the rows sharded over mesh axes, each device maps its own rows (the width
    stays whole), with the one-device result's bits.
    """
    if kind not in _ACTIVATIONS:
        raise ValueError(f"activation: kind = {kind!r}: must be one of {sorted(_ACTIVATIONS)}")
    h = jnp.asarray(h)
    _ffi.check_float("activation", "h", h)
    _ffi.check_rank("activation", "h", h, 2, "[N, 2F] (gated) or [N, F]")
    if _ACTIVATIONS[kind][0] and h.shape[-1] % 2:
        raise ValueError(f"activation: a gated activation needs [gate | up], an even width; "
                         f"got {h.shape[-1]}")
    masked = rows is not None
    if rows is None:
        rows = h.shape[0]
    elif isinstance(rows, (int, float, np.number, np.bool_)):  # known now: checked now
        rows = _ffi.int_arg("activation", "rows", rows, 0, h.shape[0], "[0, h.shape[0]]")
    else:
        rows = jnp.asarray(rows)
        if rows.size != 1:
            raise ValueError(f"activation: rows must be a scalar, got shape {list(rows.shape)}")
        rows = _ffi.as_int32("activation", "rows", rows)
    rows = jnp.asarray(rows, jnp.int32).reshape(())
    return _activation(h, rows, kind, not masked)


def _every_row(tensors, tail_zero):
    """The CUDA activation handlers take the tensors (the first `tensors` arguments) and no row
    count: they compute every row. Unless the rows past the count are known to map to 0
    (tail_zero: h is 0 there, or every row counts), they are set to 0 after."""
    def mask(out, args):
        rows = args[-1]
        return jnp.where(jnp.arange(out.shape[0])[:, None] < rows, out, jnp.zeros((), out.dtype))
    return _ffi.Cuda(args=tuple(range(tensors)), finish=None if tail_zero else mask)


def _local_rows(rows, n, split):
    """The rows below `rows` of a device's piece of n rows."""
    if split.count == 1:
        return rows
    return jnp.clip(rows - split.index() * n, 0, n).astype(jnp.int32)


def _activation_body(h, rows, *, split, kind, tail_zero):
    gated, code = _ACTIVATIONS[kind]
    width = h.shape[1] // 2 if gated else h.shape[1]
    return [_ffi.call("moekit_activation_fwd", ((h.shape[0], width), h.dtype), h,
                      _local_rows(rows, h.shape[0], split), cuda=_every_row(1, tail_zero),
                      kind=np.int32(code))]


def _activation_bwd_body(h, ct, rows, *, split, kind, tail_zero):
    return [_ffi.call("moekit_activation_bwd", (h.shape, h.dtype), h, ct,
                      _local_rows(rows, h.shape[0], split), cuda=_every_row(2, tail_zero),
                      kind=np.int32(_ACTIVATIONS[kind][1]))]


# Row by row: under a sharded jit each device maps its own rows (_token_sharding); the width
# stays whole (a gated h is [gate | up]).
_ACTIVATION_FWD = ts.token_primitive(ts.TokenOp("moekit_activation_fwd", _activation_body,
                                                (("t", "w"), ()), (("t", "v"),)))
_ACTIVATION_BWD = ts.token_primitive(ts.TokenOp("moekit_activation_bwd", _activation_bwd_body,
                                                (("t", "w"), ("t", "v"), ()), (("t", "w"),)))


# tail_zero: h's rows from `rows` on are 0 (ragged_dot's rows past its groups), as is the
# cotangent there, so computing them gives the 0 the result must hold.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _activation(h, rows, kind, tail_zero):
    return ts.bind(_ACTIVATION_FWD, h, rows, kind=kind, tail_zero=tail_zero)[0]


def _activation_fwd(h, rows, kind, tail_zero):
    return _activation(h, rows, kind, tail_zero), (h, rows)


def _activation_bwd(kind, tail_zero, res, ct):
    h, rows = res
    d_h, = ts.bind(_ACTIVATION_BWD, h, ct.astype(h.dtype), rows, kind=kind, tail_zero=tail_zero)
    return d_h, None


_activation.defvjp(_activation_fwd, _activation_bwd)


# The whole layer, one FFI call each way: weights = (router, w_in, w_out, shared_in,
# shared_out, b_in, b_out), the shared pair as [0] placeholders without a shared expert and a
# bias as [0] where there is none; bias the routing's expert_bias ([0]: none); attrs the
# handlers' LayerAttrs (_ffi.layer_attrs).
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer(x, weights, bias, attrs):
    return _layer_fwd(x, weights, bias, attrs)[0]


def _layer_fwd(x, weights, bias, attrs):
    (T, H), E = x.shape, dict(attrs)["num_experts"]
    saved_bytes, scratch_bytes, _ = _ffi.layer_workspace(attrs, T, x.dtype == jnp.bfloat16)
    f32, u8 = jnp.float32, jnp.uint8
    out, aux, z, sizes, saved, _ = _ffi.call(
        "moekit_layer_fwd", [((T, H), x.dtype), ((), f32), ((), f32), ((E,), jnp.int32),
                             ((saved_bytes,), u8), ((scratch_bytes,), u8)],
        x, *weights, bias, **dict(attrs))
    return (out, MoeAux(aux, z, sizes)), (x, weights, bias, saved)


def _layer_bwd(attrs, residuals, ct):
    x, weights, bias, saved = residuals
    d_out, d_aux = ct
    scratch_bytes = _ffi.layer_workspace(attrs, x.shape[0], x.dtype == jnp.bfloat16)[2]
    results = [(a.shape, a.dtype) for a in (x, *weights)] + [((scratch_bytes,), jnp.uint8)]
    grads = _ffi.call("moekit_layer_bwd", results, x, *weights, bias, saved,
                      d_out.astype(x.dtype), d_aux.aux_loss.astype(jnp.float32),
                      d_aux.z_loss.astype(jnp.float32), **dict(attrs))[:-1]
    d_x, *d_weights = _ffi.match_vma(tuple(grads), (x, *weights))
    return d_x, tuple(d_weights), None


_layer.defvjp(_layer_fwd, _layer_bwd)


# The layer on packed experts' weights (PackedRhs) on one device: the fused C++ forward, and
# under differentiation the steps instead, whose ragged_dot on the packed weights reaches x,
# the router and the shared expert through the weights' transposes (PackedRhs.data_t): the fused
# backward computes the experts' gradients, which packed weights do not take. weights as
# _layer's, w_in and w_out PackedRhs; o and lc the steps' options and losses.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _packed_layer(x, weights, bias, attrs, o, lc):
    router, w_in, w_out, *rest = weights
    return _layer(x, (router, w_in.data, w_out.data, *rest), bias, attrs)


def _packed_layer_fwd(x, weights, bias, attrs, o, lc):
    # symbolic_zeros: each leaf a CustomVJPPrimal, saying whether it is differentiated.
    value = functools.partial(jax.tree.map, lambda p: p.value)
    perturbed = functools.partial(jax.tree.map, lambda p: p.perturbed)
    if any(jax.tree.leaves(perturbed(weights[1:3]))):
        raise TypeError("moe_layer: packed weights (PackedRhs) take no gradient; differentiate "
                        "with the weights unpacked")
    x, weights, bias = value(x), value(weights), value(bias)
    router, w_in, w_out, *rest = weights

    def steps(x, router, rest):
        out, tokens_per_expert, logits = _steps(x, (router, w_in, w_out, *rest), bias, o)
        return out, MoeAux(*_losses(logits, o, lc), tokens_per_expert)

    out, vjp = jax.vjp(steps, x, router, rest)
    return out, vjp


def _packed_layer_bwd(attrs, o, lc, vjp, ct):
    def instantiate(c):  # symbolic_zeros: an output not differentiated comes as a SymbolicZero
        if not isinstance(c, jax.custom_derivatives.SymbolicZero):
            return c
        return (np.zeros(c.aval.shape, c.aval.dtype) if c.aval.dtype == jax.dtypes.float0 else
                jnp.zeros(c.aval.shape, c.aval.dtype))

    ct = jax.tree.map(instantiate, ct,
                      is_leaf=lambda c: isinstance(c, jax.custom_derivatives.SymbolicZero))
    d_x, d_router, d_rest = vjp(ct)
    return d_x, (d_router, None, None, *d_rest), None


_packed_layer.defvjp(_packed_layer_fwd, _packed_layer_bwd, symbolic_zeros=True)


def _token_axes(fn, token_axes, ep_axis):
    """token_axes as a tuple of mesh axis names, checked (inside shard_map, none of them
    ep_axis)."""
    if token_axes is None:
        return ()
    axes = (token_axes,) if isinstance(token_axes, str) else tuple(token_axes)
    for a in axes:
        if not isinstance(a, str):
            raise TypeError(f"{fn}: token_axes = {token_axes!r}: must be a mesh axis name or a "
                            "tuple of them")
        if a == ep_axis:
            raise ValueError(f"{fn}: token_axes = {token_axes!r} names ep_axis {ep_axis!r}, "
                             "over which the tokens are split already")
        if a not in jax.sharding.get_abstract_mesh().manual_axes:
            raise ValueError(f"{fn}: token_axes = {token_axes!r}: {a!r} is not a manual axis of "
                             "the shard_map this call is in")
    if len(set(axes)) != len(axes):
        raise ValueError(f"{fn}: token_axes = {token_axes!r} names an axis twice")
    return axes


def _split_by_tokens():
    """Whether moe_layer may run under a jit whose mesh splits its tokens: several devices, and
    not inside shard_map (there the caller has split them)."""
    return jax.device_count() > 1 and not jax.sharding.get_abstract_mesh().manual_axes


def _bytes_per_token(attrs, T, bf16):
    """Bytes per token of the fused forward's saved residual [T, bytes] when the T tokens are
    split into equal pieces of any count the devices allow: each piece holds its own saved
    buffer, whose size is not linear in its tokens."""
    pieces = [c for c in range(1, jax.device_count() + 1) if T % c == 0]
    return max(-(-_ffi.layer_workspace(attrs, T // c, bf16)[0] // (T // c)) for c in pieces)


def _fused_fwd_body(x, *weights_and_bias, split, attrs, per_token):
    T, H = x.shape
    E = int(dict(attrs)["num_experts"])
    scratch_bytes = _ffi.layer_workspace(attrs, T, x.dtype == jnp.bfloat16)[1]
    f32, u8 = jnp.float32, jnp.uint8
    out, _, _, sizes, saved, _ = _ffi.call(
        "moekit_layer_fwd", [((T, H), x.dtype), ((), f32), ((), f32), ((E,), jnp.int32),
                             ((T * per_token,), u8), ((scratch_bytes,), u8)],
        x, *weights_and_bias, **dict(attrs))
    return [out, split.sum(sizes), saved.reshape(T, per_token)]


def _fused_bwd_body(x, *args, split, attrs, per_token):
    *weights, bias, saved, d_out = args
    scratch_bytes = _ffi.layer_workspace(attrs, x.shape[0], x.dtype == jnp.bfloat16)[2]
    # Each piece's weight gradients in f32, summed over the pieces, then rounded once.
    grad_dtype = jnp.float32 if split.count > 1 else x.dtype
    results = ([(x.shape, x.dtype)] + [(w.shape, grad_dtype) for w in weights]
               + [((scratch_bytes,), jnp.uint8)])
    zero = jnp.zeros((), jnp.float32)
    d_x, *d_weights = _ffi.call("moekit_layer_bwd", results, x, *weights, bias,
                                saved.reshape(-1), d_out, zero, zero, **dict(attrs))[:-1]
    return [d_x] + [split.sum(g).astype(w.dtype) for g, w in zip(d_weights, weights)]


def _piece_losses(losses, split):
    """The loss options for one of split's pieces: its own sequences."""
    return losses._replace(sequences=losses.sequences // split.count)


def _steps_fwd_body(x, *weights_and_bias, split, options, losses):
    *weights, bias = weights_and_bias
    out, sizes, logits = _steps(x, tuple(weights), bias, options)
    aux, z = _losses(logits, options, _piece_losses(losses, split), split.axes, split.count)
    return [out, split.sum(sizes), aux, z]


def _steps_bwd_body(x, *args, split, options, losses):
    """The steps' forward again on this piece's tokens, and its gradients (the steps keep their
    residuals in arrays of shapes the piece's tokens decide, which no result of fixed shape can
    carry from the forward). The losses are the sums of the pieces' shares, so each share's
    cotangent is the loss's; the batch's counts (integers: no gradient) are summed inside."""
    *weights, bias, d_out, d_aux, d_z = args
    lc = _piece_losses(losses, split)

    def layer(x, weights):
        out, _, logits = _steps(x, weights, bias, options)
        scores, counts = (_aux_counts(logits, options, lc, split.axes) if lc.aux_loss_coeff
                          else (None, None))
        return (out, *_loss_shares(logits, scores, counts, options, lc, split.count))

    _, vjp = jax.vjp(layer, x, tuple(weights))
    d_x, d_weights = vjp((d_out, d_aux, d_z))
    return [d_x] + [split.sum(g.astype(jnp.float32)).astype(w.dtype)
                    for g, w in zip(d_weights, weights)]


# The layer on each device's tokens under a sharded jit: x, out, d_out and the saved residual
# split by tokens, the weights whole (replicated), the counts and the weight gradients summed.
_X, _W = ("t", None), (None,) * 8  # x; the seven weights and the expert bias
_FUSED_FWD = ts.token_primitive(ts.TokenOp("moekit_layer_fwd", _fused_fwd_body, (_X,) + _W,
                                           (_X, None, ("t", None))))
_FUSED_BWD = ts.token_primitive(ts.TokenOp("moekit_layer_bwd", _fused_bwd_body,
                                           (_X,) + _W + (("t", None), _X), (_X,) + _W[:7]))
_STEPS_FWD = ts.token_primitive(ts.TokenOp("moe_layer_steps_fwd", _steps_fwd_body, (_X,) + _W,
                                           (_X, None, (), ())))
_STEPS_BWD = ts.token_primitive(ts.TokenOp("moe_layer_steps_bwd", _steps_bwd_body,
                                           (_X,) + _W + (_X, (), ()), (_X,) + _W[:7]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _layer_split(x, weights, bias, attrs, options, losses):
    """(out, tokens_per_expert, aux_loss, z_loss) of the layer, each device on its own tokens
    under a sharded jit (or on the tokens it holds inside shard_map): fused (attrs: the C++
    layer's calls without its losses, which are 0 here and computed beside by the caller; its
    saved activations the residual) or step by step (attrs None; the losses of `losses`, the
    shares of every piece summed)."""
    return _layer_split_fwd(x, weights, bias, attrs, options, losses)[0]


def _layer_split_fwd(x, weights, bias, attrs, options, losses):
    if attrs is None:
        out, sizes, aux, z = ts.bind(_STEPS_FWD, x, *weights, bias, options=options,
                                     losses=losses)
        return (out, sizes, aux, z), (x, weights, bias, None)
    per_token = _bytes_per_token(attrs, x.shape[0], x.dtype == jnp.bfloat16)
    out, sizes, saved = ts.bind(_FUSED_FWD, x, *weights, bias, attrs=attrs, per_token=per_token)
    zero = jnp.zeros((), jnp.float32)
    return (out, sizes, zero, zero), (x, weights, bias, saved)


def _layer_split_bwd(attrs, options, losses, residuals, ct):
    x, weights, bias, saved = residuals
    d_out, _, d_aux, d_z = ct
    d_out = d_out.astype(x.dtype)
    if attrs is None:
        d_x, *d_weights = ts.bind(_STEPS_BWD, x, *weights, bias, d_out,
                                  d_aux.astype(jnp.float32), d_z.astype(jnp.float32),
                                  options=options, losses=losses)
    else:
        d_x, *d_weights = ts.bind(_FUSED_BWD, x, *weights, bias, saved, d_out, attrs=attrs,
                                  per_token=saved.shape[1])
    # Inside shard_map (token_axes), the replicated weights' gradients summed over the axes.
    d_x, *d_weights = _ffi.match_vma((d_x, *d_weights), (x, *weights))
    return d_x, tuple(d_weights), None


_layer_split.defvjp(_layer_split_fwd, _layer_split_bwd)


def _as_params(fn, params):
    """params as a MoeParams: one already, or a mapping with MoeParams' names (a dict, a Flax or
    Equinox tree), router, w_in and w_out required, shared_in, shared_out, b_in and b_out
    optional."""
    if isinstance(params, MoeParams):
        return params
    if not isinstance(params, collections.abc.Mapping):
        raise TypeError(f"{fn}: params must be a MoeParams or a mapping with its names "
                        f"{list(MoeParams._fields)}, got {type(params).__name__}")
    missing = [name for name in ("router", "w_in", "w_out") if name not in params]
    if missing:
        raise KeyError(f"{fn}: params lacks {missing} (has {sorted(params)}; MoeParams' names: "
                       f"{list(MoeParams._fields)})")
    unknown = sorted(set(params) - set(MoeParams._fields))
    if unknown:
        raise KeyError(f"{fn}: params has {unknown}, which moe_layer does not take "
                       f"(MoeParams' names: {list(MoeParams._fields)})")
    return MoeParams(**{name: params.get(name) for name in MoeParams._fields})


def moe_layer(x, params, *, k, score="softmax", pre_softmax=False, num_groups=None,
              group_topk=None, scaling_factor=1.0, expert_bias=None, activation_kind="swiglu",
              capacity_factor=None, drop_policy="probs", align_size=None, aux_loss_coeff=0.0,
              aux_loss_per_sequence=False, z_loss_coeff=0.0, ep_axis=None, ep_exchange="auto",
              token_axes=None, batch_invariant=False, fused=None,
              expert_weights_transposed=False):
    """The MoE layer: route, permute, gate+up grouped matmul, activation, down grouped matmul,
    combine with the routing weights, plus an optional shared expert.

    ``out = unpermute(act(permute(x) @ w_in[e]) @ w_out[e], weights)
    + act(x @ shared_in) @ shared_out``, with the router of `route` on
    ``logits = x @ router`` (float32). Each step is also a function of its own (`route`,
    `permute`, `ragged_dot`, `activation`, `unpermute`), for callers who put communication
    between them. Step by step (a GPU), the dense matmuls (the router's, the shared expert's and
    their gradients) are `jnp.dot` and follow JAX's matmul precision: on an NVIDIA GPU XLA's
    default rounds float32 inputs to TF32 (about 1e-3 relative); set
    ``jax.default_matmul_precision("highest")`` for float32 throughout, as the grouped matmuls
    compute.

    Args:
      x: ``[..., H]`` float32 or bfloat16: the T tokens of all leading axes (``[T, H]``, or
        MaxText's ``[B, S, H]``); the losses and counts are over all of them.
      params: `MoeParams`, or a mapping with its names (a dict, as Flax and Equinox hold
        weights: router, w_in, w_out, and shared_in, shared_out or neither, and the optional
        expert biases b_in ``[E, 2F | F]`` and b_out ``[E, H]``), every weight in x's dtype.
        Gradients come back in the same structure. On the CPU, w_in and w_out may be packed once
        (`pack_ragged_rhs`, in x's dtype, from either layout), for weights that do not change:
        on one device the fused forward on them (bench/results/layer_packed-cpu-2026-11-29:
        0.99-1.69x as fast as on the weights unpacked at 1-64 tokens, a Zen 4 EPYC), with
        ep_axis or fused=False the steps; with `input_gradient=True` packs, x's, the router's
        and the shared expert's gradients flow through them, by the steps (which the fused
        forward hands differentiation to: its backward computes the experts' gradients too).
        Frozen experts: leave them out of `grad`'s argnums, or `jax.lax.stop_gradient` them;
        differentiating them raises.
      k, score, pre_softmax, num_groups, group_topk, scaling_factor, expert_bias: the routing,
        as in `route`.
      activation_kind: "swiglu" (default), "geglu", "gelu" or "relu"; also the shared expert's.
      capacity_factor, drop_policy, align_size: as in `permute` (None: dropless, unaligned).
        The "probs" policy ranks an expert's tokens by their routing weights.
      aux_loss_coeff: the load-balancing loss on `aux_loss_scores` (0: not computed).
      aux_loss_per_sequence: the loss per sequence instead, averaged over the sequences: x is
        ``[..., S, H]``, each sequence the S tokens of one index of the axes before S (the C++
        layer's aux_loss_sequences; with ep_axis over every device's sequences).
      z_loss_coeff: the router z-loss (0: not computed).
      ep_axis: None, or (inside `jax.shard_map`) the mesh axis the experts are sharded over:
        expert parallelism. Then x is this device's ``[..., H]`` tokens, params.router and the
        shared expert are the same on every device, and params.w_in ``[E_loc, H, 2F | F]`` and
        params.w_out ``[E_loc, F, H]`` hold this device's experts (E_loc = E / the axis size;
        device i holds experts i*E_loc ..). Each expert's rows travel to its device and back
        (`moekit.jax.ep`), each device computing only its own experts' rows. The losses and
        tokens_per_expert are the whole batch's (over the axis), the same on every device; a
        capacity applies to each device's own tokens, before anything moves.
      ep_exchange: how rows travel over ep_axis. "all_to_all" (any backend, any launch):
        XLA's all_to_all of equal blocks of each peer's worst-case rows (`moekit.jax.ep`).
        "ragged": only the routed rows, by `jax.lax.ragged_all_to_all` (`ep.dispatch_ragged`),
        for backends that lower it (GPU, TPU; XLA:CPU's compiler refuses it). "mpi": only the
        routed rows, by moekit's MPI engine from the FFI handler (`moekit.jax.ep_mpi`), for one
        CPU device per process under mpirun; there faster than "all_to_all"
        (bench/results/jax_layer_ep-*). "auto" (default): "mpi" where `ep_mpi.serves` the
        axis, else "all_to_all" on the CPU and "ragged" on other backends.
      token_axes: None, or (inside `jax.shard_map`) the mesh axes besides ep_axis that x's
        tokens are split over, a name or a tuple (MaxText's ``("data", "fsdp")``): the losses and
        tokens_per_expert are then the whole batch's over those axes too, and the weights
        replicated over them get gradients summed over them (shard_map's rule). Without ep_axis:
        data parallelism inside shard_map, every device all the experts.
      batch_invariant: a token's output, and its gradient, the same bits whatever the other
        tokens of the call, the threads, and over ep_axis the number of devices: every matmul
        (the router's and the shared expert's too, as one-group `ragged_dot` calls) in
        `ragged_dot`'s batch-invariant mode; the other steps work token by token already. Not
        where the result depends on the batch by definition: the tokens a capacity drops, and
        the gradient through the load-balancing loss or the z-loss. CPU only.
      expert_weights_transposed: params.w_in ``[E, 2F | F, H]`` and params.w_out ``[E, H, F]``
        (``E_loc`` with ep_axis): each expert's weights as linear layers' ``[out, in]``, as
        PyTorch and Hugging Face checkpoints store them, read as they lie (no transpose, forward
        or backward), their gradients in the same layout: against a swapaxes to ``[E, in, out]``
        in the step, qwen3-30b-a3b's forward ran 5.5-9.3x faster. On a Xeon with AMX the layer's
        forward ran 1.3-1.7x faster on ``[out, in]`` than on ``[in, out]`` from 64 tokens, its
        backward 0-17% slower (bench/results/layer_weight_layout-cpu-2026-11-28). The router and
        the shared expert keep their layouts.
      fused: how the layer runs. True: one call each way, the C++ layer's forward and backward
        (`moekit/layer.h`) with its saved activations as the residual: what the C++ layer does
        once, done once (bench/results/jax_layer-*); on the CPU without ep_axis. False: step by
        step, each step a call of its own (as with ep_axis, whose exchanges run between the
        steps). None (default): fused where it can be, except in the batch-invariant mode, whose
        promise spans the number of devices: there the steps, which the layer over ep_axis
        takes too, so that its bits are the same on one device and on several (the fused call
        sums d_x's parts, and rounds a bf16 shared expert's output, in another order).

    Returns:
      ``(out [..., H] (x's shape and dtype), MoeAux(aux_loss, z_loss, tokens_per_expert))``.
      Gradients flow to x and every weight (not to expert_bias), through the losses too, by moekit's
      C++ backward of each step (or of the whole layer, fused). With ep_axis, the gradients of the
      replicated weights are summed over the axis by shard_map, as for any replicated input.

    Under `jit` on several devices, with x's tokens sharded over any mesh axes (e.g. a
    ``[B, S, H]`` x with B over ``("data", "fsdp")``) and the weights replicated, each device runs
    the layer on its own tokens (fused or step by step) and nothing token-indexed is gathered; the
    losses and tokens_per_expert are the whole batch's, and the weights' gradients are summed
    over the devices (in float32, rounded once), so that every result is the one-device layer's
    up to float32 summation order (out and d_x bit for bit in the batch-invariant mode, over a
    power-of-two number of devices). Fused, the losses are computed beside the C++ layer, on the
    router matmul computed once more (about 1% of the layer); step by step (a GPU, the
    batch-invariant mode, fused=False), each device's backward computes its forward again (a
    third more work). This path is taken in any process with several devices outside
    shard_map, whether or not the tokens are sharded. Two cases differ: a capacity
    ranks every token of an expert, so with capacity_factor the tokens are gathered (the result
    is the one-device layer's); with align_size each device pads its own blocks, and
    tokens_per_expert sums the devices' padded counts (as over ep_axis).

    Under `vmap` each step runs as a loop of calls (see the package docstring).
    """
    fn = "moe_layer"
    x = jnp.asarray(x)
    if x.ndim < 1:
        raise ValueError(f"{fn}: x must be [..., H], got a scalar")
    _ffi.check_float(fn, "x", x)
    aux_loss_per_sequence = _ffi.bool_arg(fn, "aux_loss_per_sequence", aux_loss_per_sequence)
    if aux_loss_per_sequence and x.ndim < 3:
        raise ValueError(f"{fn}: aux_loss_per_sequence needs x [..., S, H] (the sequences), got "
                         f"shape {tuple(x.shape)}")
    shape = x.shape
    sequences = math.prod(shape[:-2]) if aux_loss_per_sequence else 0
    x = x.reshape(-1, shape[-1])  # [T, H]
    params = _as_params(fn, params)
    if sequences > 2**31 - 1:
        raise ValueError(f"{fn}: {sequences} sequences: must be at most 2^31 - 1")
    out, aux = _moe_layer(fn, x, params, k, score, pre_softmax, num_groups, group_topk,
                          scaling_factor, expert_bias, activation_kind, capacity_factor,
                          drop_policy, align_size, aux_loss_coeff, sequences, z_loss_coeff,
                          ep_axis, ep_exchange, token_axes, batch_invariant, fused,
                          expert_weights_transposed)
    return out.reshape(shape), aux


def _moe_layer(fn, x, params, k, score, pre_softmax, num_groups, group_topk, scaling_factor,
               expert_bias, activation_kind, capacity_factor, drop_policy, align_size,
               aux_loss_coeff, sequences, z_loss_coeff, ep_axis, ep_exchange, token_axes,
               batch_invariant, fused, expert_weights_transposed):
    """moe_layer on x [T, H] (sequences: the per-sequence loss's count, 0 for the batch's)."""
    T, H = x.shape
    router = jnp.asarray(params.router)
    # Packed experts' weights (pack_ragged_rhs) keep their shape before packing, [E, in, out].
    w_in, w_out = (w if isinstance(w, PackedRhs) else jnp.asarray(w) for w in params[1:3])
    packed = isinstance(w_in, PackedRhs)
    if packed != isinstance(w_out, PackedRhs):
        raise ValueError(f"{fn}: params.w_in and params.w_out: pack both (pack_ragged_rhs) or "
                         f"neither")
    if router.ndim != 2 or router.shape[0] != H:
        raise ValueError(f"{fn}: params.router must be [H, E] with H = {H}, got "
                         f"{tuple(router.shape)}")
    E = router.shape[1]
    if ep_exchange not in _EXCHANGES:
        raise ValueError(f"{fn}: ep_exchange = {ep_exchange!r}: must be one of "
                         f"{list(_EXCHANGES)}")
    ranks = 1 if ep_axis is None else jax.lax.axis_size(ep_axis)
    token_axes = _token_axes(fn, token_axes, ep_axis)
    # The axes the batch's tokens are split over, and into how many pieces: the losses and the
    # counts reduce over them.
    batch_axes = token_axes + (() if ep_axis is None else (ep_axis,))
    pieces = math.prod(jax.lax.axis_size(a) for a in batch_axes)
    if ep_exchange == "auto" and ep_axis is not None:
        ep_exchange = ("mpi" if ep_mpi.serves(ranks) else
                       "all_to_all" if jax.default_backend() == "cpu" else "ragged")
    if E % ranks:
        raise ValueError(f"{fn}: the {E} experts do not divide over the {ranks} devices of "
                         f"ep_axis {ep_axis!r}")
    E_loc = E // ranks  # the experts whose weights this call holds
    if activation_kind not in _ACTIVATIONS:
        raise ValueError(f"{fn}: activation_kind = {activation_kind!r}: must be one of "
                         f"{sorted(_ACTIVATIONS)}")
    gated = _ACTIVATIONS[activation_kind][0]
    experts = "E" if ep_axis is None else "E_loc"
    # The experts' weights [E, in, out], or [E, out, in] transposed.
    t = _ffi.bool_arg(fn, "expert_weights_transposed", expert_weights_transposed)
    layout = ", expert_weights_transposed" if t else ""
    if packed and t:
        raise ValueError(f"{fn}: packed experts' weights (PackedRhs) are not with "
                         f"expert_weights_transposed: pack_ragged_rhs(w, rhs_transposed=True) "
                         f"reads [E, out, in] weights")
    if w_out.ndim != 3 or w_out.shape[0] != E_loc or w_out.shape[1 if t else 2] != H:
        want = (f"[{experts}, H, F] = [{E_loc}, {H}, F]" if t
                else f"[{experts}, F, H] = [{E_loc}, F, {H}]")
        raise ValueError(f"{fn}: params.w_out must be {want}{layout}, got "
                         f"{tuple(w_out.shape)}")
    F = w_out.shape[2 if t else 1]
    width, width_name = (2 * F, "2F") if gated else (F, "F")
    want_in = (E_loc, width, H) if t else (E_loc, H, width)
    if tuple(w_in.shape) != want_in:
        names = f"[{experts}, {width_name}, H]" if t else f"[{experts}, H, {width_name}]"
        raise ValueError(f"{fn}: params.w_in must be {list(want_in)} "
                         f"({names}{', gate | up' if gated else ''}{layout}), got "
                         f"{tuple(w_in.shape)}")
    for name, w in (("router", router), ("w_in", w_in), ("w_out", w_out)):
        if w.dtype != x.dtype:
            raise TypeError(f"{fn}: params.{name} is {w.dtype}, x is {x.dtype}")
    if (params.shared_in is None) != (params.shared_out is None):
        raise ValueError(f"{fn}: params.shared_in and params.shared_out: give both or neither")
    shared = params.shared_in is not None
    if shared:
        shared_in, shared_out = jnp.asarray(params.shared_in), jnp.asarray(params.shared_out)
        if (shared_in.ndim != 2 or shared_out.ndim != 2 or shared_in.shape[0] != H
                or shared_out.shape[1] != H or shared_in.shape[1] != (
                    2 * shared_out.shape[0] if gated else shared_out.shape[0])):
            raise ValueError(f"{fn}: params.shared_in {tuple(shared_in.shape)} and shared_out "
                             f"{tuple(shared_out.shape)} must be [H, 2Fs | Fs] and [Fs, H]")
        for name, w in (("shared_in", shared_in), ("shared_out", shared_out)):
            if w.dtype != x.dtype:
                raise TypeError(f"{fn}: params.{name} is {w.dtype}, x is {x.dtype}")
    biases = []
    for name, value, want in (("b_in", params.b_in, (E_loc, width)),
                              ("b_out", params.b_out, (E_loc, H))):
        if value is None:
            biases.append(None)
            continue
        b = jnp.asarray(value)
        if tuple(b.shape) != want:
            raise ValueError(f"{fn}: params.{name} must be [{experts}, "
                             f"{'2F | F' if name == 'b_in' else 'H'}] = {list(want)}, got "
                             f"{tuple(b.shape)}")
        if b.dtype != x.dtype:
            raise TypeError(f"{fn}: params.{name} is {b.dtype}, x is {x.dtype}")
        biases.append(b)

    # Every option checked here, so that an error names moe_layer, not a step.
    bias, route_attrs_ = route_attrs(fn, E, k, score, pre_softmax, num_groups, group_topk,
                                     scaling_factor, expert_bias)
    align, cf, policy = capacity_options(fn, align_size, capacity_factor, drop_policy)
    aux_loss_coeff = _ffi.float_arg(fn, "aux_loss_coeff", aux_loss_coeff)
    z_loss_coeff = _ffi.float_arg(fn, "z_loss_coeff", z_loss_coeff)
    batch_invariant = _ffi.bool_arg(fn, "batch_invariant", batch_invariant)
    if fused is not None:
        fused = _ffi.bool_arg(fn, "fused", fused)

    can_fuse = ep_axis is None and jax.default_backend() == "cpu"
    if packed:
        # The C++ layer's forward on packed weights (MoeLayerConfig::expert_weights_packed), or,
        # with ep_axis or fused = False, the steps with ragged_dot on them.
        refused = [what for what, given in (
            ("token_axes", bool(token_axes)),
            (f"the {jax.default_backend()} backend", jax.default_backend() != "cpu"),
            ("several devices under jit", ep_axis is None and _split_by_tokens())) if given]
        if refused:
            raise ValueError(f"{fn}: packed experts' weights (PackedRhs) run on the CPU, on one "
                             f"device or each device its experts' (ep_axis); not with "
                             f"{', '.join(refused)}")
        fused = can_fuse and fused is not False
    if fused and not can_fuse:
        here = f"ep_axis = {ep_axis!r}" if ep_axis is not None else jax.default_backend()
        raise ValueError(f"{fn}: fused = True runs on the CPU without ep_axis (here {here})")
    fused = can_fuse and (fused or (fused is None and not batch_invariant))
    o = _Options(k=k, score=score, pre_softmax=pre_softmax, num_groups=num_groups,
                 group_topk=group_topk, scaling_factor=scaling_factor,
                 activation_kind=activation_kind, capacity_factor=capacity_factor,
                 drop_policy=drop_policy, align_size=align_size, batch_invariant=batch_invariant,
                 expert_weights_transposed=t)
    none = jnp.zeros((0,), x.dtype)
    weights = (router, w_in, w_out, shared_in if shared else none,
               shared_out if shared else none, *(none if b is None else b for b in biases))
    lc = _Losses(aux_loss_coeff, sequences, z_loss_coeff)
    # Under jit on several devices each device runs the layer on its own tokens, wherever they
    # are sharded (_layer_split). Not with a capacity, which ranks every token of an expert:
    # XLA then gathers the tokens.
    split = (ep_axis is None and not token_axes and T > 0 and capacity_factor is None
             and _split_by_tokens())
    # The fused C++ layer counts its own tokens only: under a sharded jit, or inside shard_map
    # over token_axes, it computes no loss, and the batch's losses are computed beside it.
    beside = fused and (split or bool(token_axes))
    if fused:
        attrs = _ffi.layer_attrs(
            hidden=H, ffn=F, num_experts=E, shared_ffn=shared_out.shape[0] if shared else 0,
            **dict(route_attrs_), activation=_ACTIVATIONS[activation_kind][1],
            capacity_factor=cf, drop_policy=policy, align_size=align,
            aux_loss_coeff=0.0 if beside else aux_loss_coeff,
            aux_loss_sequences=0 if beside else sequences,
            z_loss_coeff=0.0 if beside else z_loss_coeff, batch_invariant=batch_invariant,
            expert_weights_transposed=t, expert_weights_packed=packed)
        if _ffi.layer_workspace(attrs, T, x.dtype == jnp.bfloat16) is None:
            raise ValueError(f"{fn}: {T} tokens, H = {H}, F = {F}, {E} experts, k = {k}, "
                             f"align_size = {align_size}, capacity_factor = {capacity_factor}: "
                             f"the layer's buffers would not fit a 64-bit size")
    if split or beside:
        out, tokens_per_expert, aux, z = _layer_split(x, weights, bias,
                                                      attrs if fused else None, o, lc)
        if token_axes:
            tokens_per_expert = jax.lax.psum(tokens_per_expert, token_axes)
        if beside:
            logits = _dense(x, router, batch_invariant) if aux_loss_coeff or z_loss_coeff else None
            aux, z = _losses(logits, o, lc, batch_axes, pieces)
        return out, MoeAux(aux, z, tokens_per_expert)
    if fused:
        return (_packed_layer(x, weights, bias, attrs, o, lc) if packed else
                _layer(x, weights, bias, attrs))
    exchange = None if ep_axis is None else (ep_exchange, ranks)
    out, tokens_per_expert, logits = _steps(x, weights, bias, o, ep_axis, exchange)
    if token_axes:
        tokens_per_expert = jax.lax.psum(tokens_per_expert, token_axes)
    aux, z = _losses(logits, o, lc, batch_axes, pieces)
    return out, MoeAux(aux, z, tokens_per_expert)


class _Options(NamedTuple):
    """The layer's checked options that the steps take (hashable: a primitive parameter)."""
    k: int
    score: str
    pre_softmax: bool
    num_groups: Optional[int]
    group_topk: Optional[int]
    scaling_factor: float
    activation_kind: str
    capacity_factor: Optional[float]
    drop_policy: str
    align_size: Optional[int]
    batch_invariant: bool
    expert_weights_transposed: bool


def _dense(a, w, batch_invariant):
    """a @ w in f32; in the batch-invariant mode as one ragged_dot group of every row."""
    if not batch_invariant:
        return jnp.dot(a, w, preferred_element_type=jnp.float32)
    # (The size as a full of a literal, not an array constant: the steps are traced inside
    # custom_partitioning, which takes no constants.)
    return ragged_dot(a, w[None], jnp.full((1,), a.shape[0], jnp.int32),
                      preferred_element_type=jnp.float32, batch_invariant=True)


def _route_of(logits, bias, o):
    return route(logits, o.k, score=o.score, pre_softmax=o.pre_softmax,
                 num_groups=o.num_groups, group_topk=o.group_topk,
                 scaling_factor=o.scaling_factor, expert_bias=bias if bias.size else None)


class _Losses(NamedTuple):
    """The layer's loss options, checked (sequences: the per-sequence loss's count of this
    call's sequences, 0 for the batch's loss)."""
    aux_loss_coeff: float
    sequences: int
    z_loss_coeff: float


def _aux_counts(logits, o, lc, axes):
    """The load-balancing loss's scores [T, E] and counts: [E] the batch's (summed over the mesh
    axes `axes` the batch is split over), or [B, E] per sequence (this call's sequences)."""
    E = logits.shape[1]
    scores, aux_map = aux_loss_scores(logits, o.k, score=o.score)
    if lc.sequences:
        return scores, jnp.sum(aux_map.reshape(lc.sequences, -1, E), axis=1, dtype=jnp.int32)
    counts = jnp.sum(aux_map, axis=0, dtype=jnp.int32)
    return scores, jax.lax.psum(counts, axes) if axes else counts


def _loss_shares(logits, scores, counts, o, lc, pieces):
    """This call's shares of the batch's load-balancing loss and z-loss, from its logits [T, E]
    and _aux_counts' scores and counts, with the batch split into `pieces` calls of T tokens:
    the losses are the shares' sums (the load-balancing loss on the batch's counts and token
    count; per sequence, and the z-loss, the means of the pieces' means)."""
    zero = jnp.zeros((), jnp.float32)
    aux = zero
    if lc.aux_loss_coeff and lc.sequences:
        aux = load_balancing_loss(scores, counts, k=o.k, coeff=lc.aux_loss_coeff) / pieces
    elif lc.aux_loss_coeff:
        aux = load_balancing_loss(scores, counts, k=o.k, coeff=lc.aux_loss_coeff,
                                  total_tokens=logits.shape[0] * pieces if pieces > 1 else None)
    z = z_loss(logits, lc.z_loss_coeff) / pieces if lc.z_loss_coeff else zero
    return aux, z


def _losses(logits, o, lc, axes=(), pieces=1):
    """The batch's load-balancing loss and z-loss from this call's logits [T, E] (None where
    both coefficients are 0). Inside shard_map the batch is split over the mesh axes `axes`
    (ep_axis and token_axes) into `pieces`, and the devices' shares are summed over them."""
    zero = jnp.zeros((), jnp.float32)
    if not (lc.aux_loss_coeff or lc.z_loss_coeff):
        return zero, zero
    scores, counts = _aux_counts(logits, o, lc, axes) if lc.aux_loss_coeff else (None, None)
    aux, z = _loss_shares(logits, scores, counts, o, lc, pieces)
    return (jax.lax.psum(aux, axes), jax.lax.psum(z, axes)) if axes else (aux, z)


def _add_group_bias(rows, sizes, bias):
    """rows [R, n] + bias [G, n] row g on the rows of group g (sizes [G]), in float32 and
    rounded once to rows' dtype; rows past the groups stay as they are (0), as the C++ layer's
    add_group_bias does."""
    ends = jnp.cumsum(sizes)
    r = jnp.arange(rows.shape[0], dtype=ends.dtype)
    group = jnp.minimum(jnp.searchsorted(ends, r, side="right"), bias.shape[0] - 1)  # [R]
    summed = (rows.astype(jnp.float32) + bias[group].astype(jnp.float32)).astype(rows.dtype)
    return jnp.where((r < ends[-1])[:, None], summed, rows)


def _steps(x, weights, bias, o, ep_axis=None, exchange=None):
    """The layer step by step on x [T, H]: (out [T, H], tokens_per_expert [E], logits [T, E]
    f32). weights as _layer's; bias the expert bias ([0]: none). With ep_axis, exchange is
    (ep_exchange, ranks), and tokens_per_expert is the whole batch's."""
    router, w_in, w_out, shared_in, shared_out, b_in, b_out = weights
    T, E = x.shape[0], router.shape[1]
    logits = _dense(x, router, o.batch_invariant)  # [T, E]
    r = _route_of(logits, bias, o)
    by_probs = o.capacity_factor is not None and o.drop_policy == "probs"
    p = permute(x, r.topk_indices, r.topk_weights if by_probs else None, num_experts=E,
                align_size=o.align_size, capacity_factor=o.capacity_factor,
                drop_policy=o.drop_policy)
    tokens_per_expert = p.tokens_per_expert
    if ep_axis is None:
        rows, sizes = p.x, p.tokens_per_expert  # [N, H], [E]
    else:
        ep_exchange, ranks = exchange
        dispatch, combine = _EXCHANGES[ep_exchange]
        capacity = ep.block_rows(T, E, ranks, o.k, rows=p.x.shape[0],
                                 capacity_factor=o.capacity_factor, align_size=o.align_size)
        rows, plan = dispatch(p.x, p.tokens_per_expert, ep_axis, capacity=capacity)
        sizes = plan.local_tokens_per_expert  # [E_loc]
        tokens_per_expert = jax.lax.psum(tokens_per_expert, ep_axis)
    def experts_dot(a, w):  # a @ w[e] on the rows of expert e, w in the experts' layout
        if isinstance(w, PackedRhs):
            return ragged_dot(a, w, sizes, batch_invariant=o.batch_invariant)
        return _ragged_rows("moe_layer", a, w, sizes, None, None, None, o.batch_invariant,
                            rhs_transposed=o.expert_weights_transposed)

    h = experts_dot(rows, w_in)  # [rows, 2F | F]; 0 past the groups
    if b_in.size:
        h = _add_group_bias(h, sizes, b_in)
    # The groups' rows only (on a GPU every row: those past the groups are 0 and map to 0).
    a = _activation(h, jnp.sum(sizes).astype(jnp.int32), o.activation_kind, True)
    y = experts_dot(a, w_out)  # [rows, H]
    if b_out.size:
        y = _add_group_bias(y, sizes, b_out)
    if ep_axis is not None:
        y = combine(y, plan, ep_axis)  # [N, H], back in p.x's order
    out = unpermute(y, p, r.topk_weights)  # [T, H]
    if shared_in.size:
        hs = _dense(x, shared_in, o.batch_invariant).astype(x.dtype)
        out = out + _dense(activation(hs, o.activation_kind), shared_out,
                           o.batch_invariant).astype(x.dtype)
    return out, tokens_per_expert, logits
