"""The router: top-k expert choice and its weights, the aux-loss scores, and the losses
(SPEC.md section 2), each with its C++ backward."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moekit.jax import _ffi
from moekit.jax import _token_sharding as ts

__all__ = ["Route", "aux_loss_scores", "count_tokens_per_expert", "load_balancing_loss", "route",
           "update_expert_bias", "z_loss"]

# RouterScore's values in include/moekit/router.h.
_SCORES = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}


class Route(NamedTuple):
    """route's outputs. T tokens, E experts, k chosen per token."""
    probs: jax.Array         # [T, E] logits' dtype: the weights at the chosen experts, 0 else
    routing_map: jax.Array   # [T, E] bool: True at the chosen experts
    topk_indices: jax.Array  # [T, k] int32: by descending weight (ties: the lower index)
    topk_weights: jax.Array  # [T, k] logits' dtype: their weights, in the same order


def _score_code(fn, score):
    if score not in _SCORES:
        raise ValueError(f"{fn}: score = {score!r}: must be one of {sorted(_SCORES)}")
    return _SCORES[score]


def _route_outputs(logits, k):
    T, E = logits.shape
    return [((T, E), logits.dtype), ((T, E), jnp.bool_), ((T, k), jnp.int32),
            ((T, k), logits.dtype)]


def _route_body(logits, bias, *, split, **attrs):
    return _ffi.call("moekit_route_fwd", _route_outputs(logits, int(attrs["k"])), logits, bias,
                     cuda=_ffi.Cuda(), **attrs)


def _route_bwd_body(logits, idx, d_probs, d_weights, *, split, **attrs):
    return [_ffi.call("moekit_route_bwd", (logits.shape, logits.dtype), logits, idx, d_probs,
                      d_weights, cuda=_ffi.Cuda(), **attrs)]


# Token by token: under a sharded jit each device routes its own tokens (_token_sharding).
_ROUTE_FWD = ts.token_primitive(ts.TokenOp(
    "moekit_route_fwd", _route_body, (("t", "e"), ("e0",)),
    (("t", "e"), ("t", "e"), ("t", "k"), ("t", "k"))))
_ROUTE_BWD = ts.token_primitive(ts.TokenOp(
    "moekit_route_bwd", _route_bwd_body, (("t", "e"), ("t", "k"), ("t", "e"), ("t", "k")),
    (("t", "e"),)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _route(logits, bias, attrs):
    return Route(*ts.bind(_ROUTE_FWD, logits, bias, **dict(attrs)))


def _route_fwd(logits, bias, attrs):
    out = _route(logits, bias, attrs)
    return out, (logits, bias, out.topk_indices)


def _route_bwd(attrs, residuals, ct):
    logits, bias, idx = residuals
    d_logits, = ts.bind(_ROUTE_BWD, logits, idx, ct.probs, ct.topk_weights, **dict(attrs))
    # The bias chooses; it is not differentiated.
    return _ffi.match_vma((d_logits, jnp.zeros_like(bias)), (logits, bias))


_route.defvjp(_route_fwd, _route_bwd)


def route(logits, k, *, score="softmax", pre_softmax=False, num_groups=None, group_topk=None,
          scaling_factor=1.0, expert_bias=None):
    """Chooses k of E experts per token and weights them (SPEC.md section 2).

    Per token x (a row of logits):
      softmax, post (default; Mixtral, Qwen3): the top k of x, weights softmax(x[chosen]);
      softmax, pre_softmax (DeepSeek-V2): s = softmax(x), its top k, weights s[chosen];
      sigmoid / sqrtsoftplus (DeepSeek-V3): s = act(x), the top k of s + expert_bias,
        weights s[chosen] / (sum + 1e-20) when k > 1.
    Group-limited routing (num_groups, group_topk): the E experts form num_groups equal groups,
    a group scores the sum of its top k / group_topk selection scores, and only the experts of
    the best group_topk groups can be chosen. Weights are finally multiplied by scaling_factor.
    Ties go to the lower expert index, as in `jax.lax.top_k`. NaN logits: a NaN selection score
    ranks below every number, -inf included (NaNs by index), and the weights are NaN wherever
    their formula takes a NaN (softmax pre: the whole row); NaN weights are ordered last (the
    C++ router's rule, `moekit/router.h`).

    Args:
      logits: ``[T, E]`` float32 or bfloat16.
      k: experts per token, in [1, E].
      score: "softmax", "sigmoid" or "sqrtsoftplus".
      pre_softmax: softmax only: softmax over all E before the top-k.
      num_groups, group_topk: both or neither; E % num_groups == 0, k % group_topk == 0.
      scaling_factor: multiplies the weights.
      expert_bias: ``[E]`` float32, sigmoid and sqrtsoftplus only: added to the scores to
        choose, never a weight, not differentiated.

    Returns:
      `Route(probs, routing_map, topk_indices, topk_weights)`; topk_indices are ordered by
      weight (differs from the choice order only when a bias reorders it).

    Gradients flow to `logits` from `probs` and `topk_weights` (summed); the choice itself is
    not differentiated. Under `jit` with the tokens sharded over mesh axes, each device routes
    its own tokens (E stays whole), with the one-device result's bits.
    """
    fn = "route"
    logits = jnp.asarray(logits)
    _ffi.check_rank(fn, "logits", logits, 2, "[T, E]")
    _ffi.check_float(fn, "logits", logits)
    bias, attrs = route_attrs(fn, logits.shape[1], k, score, pre_softmax, num_groups,
                              group_topk, scaling_factor, expert_bias)
    return _route(logits, bias, attrs)


def route_attrs(fn, E, k, score, pre_softmax, num_groups, group_topk, scaling_factor,
                expert_bias):
    """route's arguments for E experts checked (errors name `fn`): (expert_bias as a float32
    [E] array, or [0] for none; the handlers' routing attributes)."""
    k = _ffi.int_arg(fn, "k", k, 1, E, "[1, E]")
    code = _score_code(fn, score)
    pre_softmax = _ffi.bool_arg(fn, "pre_softmax", pre_softmax)
    if pre_softmax and score != "softmax":
        raise ValueError(f"{fn}: pre_softmax = True needs score = 'softmax', got {score!r}")
    scaling_factor = _ffi.float_arg(fn, "scaling_factor", scaling_factor)
    if (num_groups is None) != (group_topk is None):
        raise ValueError(f"{fn}: num_groups = {num_groups} and group_topk = {group_topk}: "
                         "give both or neither")
    if num_groups is not None:  # the C++ router's rules (check_route_options), named here
        num_groups = _ffi.int_arg(fn, "num_groups", num_groups, 1, E, "[1, E]")
        if E % num_groups:
            raise ValueError(f"{fn}: num_groups = {num_groups}: must divide E = {E}")
        group_topk = _ffi.int_arg(fn, "group_topk", group_topk, 1, num_groups, "[1, num_groups]")
        if k % group_topk:
            raise ValueError(f"{fn}: group_topk = {group_topk}: must divide k = {k}")
        if k // group_topk > E // num_groups:
            raise ValueError(f"{fn}: k = {k}: k / group_topk = {k // group_topk} must be <= the "
                             f"{E // num_groups} experts of a group")
    if expert_bias is None:
        bias = jnp.zeros((0,), jnp.float32)
    else:
        if score == "softmax":
            raise ValueError(f"{fn}: expert_bias needs score 'sigmoid' or 'sqrtsoftplus', "
                             "got 'softmax'")
        bias = jnp.asarray(expert_bias, jnp.float32)
        if bias.shape != (E,):
            raise ValueError(f"{fn}: expert_bias must be [E] = [{E}], got shape "
                             f"{tuple(bias.shape)}")
    attrs = (("k", np.int32(k)), ("score", np.int32(code)), ("pre_softmax", np.bool_(pre_softmax)),
             ("num_groups", np.int32(num_groups or 0)), ("group_topk", np.int32(group_topk or 0)),
             ("scaling_factor", np.float32(scaling_factor)))
    return bias, attrs


def _aux_body(logits, *, split, **attrs):
    T, E = logits.shape
    return _ffi.call("moekit_aux_scores_fwd", [((T, E), jnp.float32), ((T, E), jnp.bool_)],
                     logits, cuda=_ffi.Cuda(), **attrs)


def _aux_bwd_body(logits, d_scores, *, split, **attrs):
    return [_ffi.call("moekit_aux_scores_bwd", (logits.shape, logits.dtype), logits, d_scores,
                      cuda=_ffi.Cuda(), **attrs)]


_AUX_FWD = ts.token_primitive(ts.TokenOp("moekit_aux_scores_fwd", _aux_body, (("t", "e"),),
                                         (("t", "e"), ("t", "e"))))
_AUX_BWD = ts.token_primitive(ts.TokenOp("moekit_aux_scores_bwd", _aux_bwd_body,
                                         (("t", "e"), ("t", "e")), (("t", "e"),)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _aux(logits, attrs):
    return tuple(ts.bind(_AUX_FWD, logits, **dict(attrs)))


def _aux_fwd(logits, attrs):
    return _aux(logits, attrs), logits


def _aux_bwd(attrs, logits, ct):
    d_scores, _ = ct
    d_logits, = ts.bind(_AUX_BWD, logits, d_scores, **dict(attrs))
    return _ffi.match_vma((d_logits,), (logits,))


_aux.defvjp(_aux_fwd, _aux_bwd)


def aux_loss_scores(logits, k, *, score="softmax"):
    """Scores for the load-balancing loss, dense and normalised over all E, and their routing map.

    softmax: softmax(x); sigmoid / sqrtsoftplus: s / (sum(s) + 1e-20) with s = act(x). The map is
    the top k of these scores (no groups, no bias).

    Args:
      logits: ``[T, E]`` float32 or bfloat16.
      k: experts per token, in [1, E].
      score: "softmax", "sigmoid" or "sqrtsoftplus".

    Returns:
      ``(scores [T, E] float32, routing_map [T, E] bool)``; gradients flow to logits from scores.
      Under a sharded `jit`, token by token on each device, as `route`.
    """
    fn = "aux_loss_scores"
    logits = jnp.asarray(logits)
    _ffi.check_rank(fn, "logits", logits, 2, "[T, E]")
    _ffi.check_float(fn, "logits", logits)
    k = _ffi.int_arg(fn, "k", k, 1, logits.shape[1], "[1, E]")
    return _aux(logits, (("k", np.int32(k)), ("score", np.int32(_score_code(fn, score)))))


def _unit_cotangent(shape, dtype):
    """A loss backward on CUDA, whose handler cannot read the cotangent d_loss (the second and
    last argument) from device memory without waiting for the GPU: it takes the first argument
    alone and d_loss = 1 as an attribute, and gives the gradient in float32, scaled here by the
    traced cotangent and rounded once."""
    def scale(d, args):
        return (d * args[-1]).astype(dtype)
    return _ffi.Cuda(args=(0,), attrs={"d_loss": np.float32(1)}, results=(shape, jnp.float32),
                     finish=scale)


def _balance_attrs(attrs, scores, split):
    """The loss's attributes for a device's piece of the tokens: the batch's token count where
    the caller gave none (the kernel would count the piece's)."""
    if split.count > 1 and not attrs["per_sequence"] and not attrs["total_tokens"]:
        attrs = {**attrs, "total_tokens": np.int64(scores.shape[0] * split.count)}
    return attrs


def _balance_body(scores, tokens_per_expert, *, split, **attrs):
    cuda = _ffi.Cuda(workspace=_ffi.cuda_router_workspace_bytes(*scores.shape))
    loss = _ffi.call("moekit_load_balancing_loss_fwd", ((), jnp.float32), scores,
                     tokens_per_expert, cuda=cuda, **_balance_attrs(attrs, scores, split))
    # The batch's loss is the sum of the pieces' terms; the per-sequence loss the mean of the
    # pieces' means over their (as many) sequences.
    return [split.mean(loss) if attrs["per_sequence"] else split.sum(loss)]


def _balance_bwd_body(scores, tokens_per_expert, d_loss, *, split, **attrs):
    """scores gives the gradient's shape (the kernel reads only the counts and d_loss)."""
    if attrs["per_sequence"]:
        d_loss = split.share(d_loss)
    return [_ffi.call("moekit_load_balancing_loss_bwd", (scores.shape, scores.dtype),
                      tokens_per_expert, d_loss,
                      cuda=_unit_cotangent(scores.shape, scores.dtype),
                      **_balance_attrs(attrs, scores, split))]


# tokens_per_expert: [E] the batch's counts (whole on every device), or [B, E] per sequence
# (split with the tokens, B dividing the pieces).
def _balance_ops(per_sequence):
    counts = ("seq", "e") if per_sequence else ("e",)
    fwd = ts.token_primitive(ts.TokenOp("moekit_load_balancing_loss_fwd", _balance_body,
                                        (("t", "e"), counts), ((),)))
    bwd = ts.token_primitive(ts.TokenOp("moekit_load_balancing_loss_bwd", _balance_bwd_body,
                                        (("t", "e"), counts, ()), (("t", "e"),)))
    return fwd, bwd


_BALANCE = {per_sequence: _balance_ops(per_sequence) for per_sequence in (False, True)}


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _balance(scores, tokens_per_expert, attrs):
    fwd, _ = _BALANCE[bool(dict(attrs)["per_sequence"])]
    return ts.bind(fwd, scores, tokens_per_expert, **dict(attrs))[0]


def _balance_fwd(scores, tokens_per_expert, attrs):
    return _balance(scores, tokens_per_expert, attrs), (scores, tokens_per_expert)


def _balance_bwd(attrs, residuals, d_loss):
    scores, tokens_per_expert = residuals
    _, bwd = _BALANCE[bool(dict(attrs)["per_sequence"])]
    d_scores, = ts.bind(bwd, scores, tokens_per_expert, d_loss.astype(jnp.float32),
                        **dict(attrs))
    return _ffi.match_vma((d_scores,), (scores,)) + (None,)


_balance.defvjp(_balance_fwd, _balance_bwd)


def load_balancing_loss(scores, tokens_per_expert, *, k, coeff=1.0, total_tokens=None):
    """The Switch / GShard load-balancing loss (SPEC.md section 2).

    With tokens_per_expert ``[E]`` (counts of the whole batch):
      ``loss = E * coeff / (k * T_total^2) * sum_e (sum_t scores[t, e]) * tokens_per_expert[e]``,
      T_total = total_tokens (the whole batch's tokens, for a shard of it) or T.
    With tokens_per_expert ``[B, E]`` (counts per sequence; tokens batch-major, T = B * S): the
    same loss per sequence with T_total = S, averaged over the B sequences; total_tokens must
    then be None.

    Args:
      scores: ``[T, E]`` float32 or bfloat16, from `aux_loss_scores`.
      tokens_per_expert: ``[E]`` or ``[B, E]`` int32 (e.g. the routing map summed over tokens).
      k: experts per token; coeff: the loss coefficient.

    Returns:
      a float32 scalar; gradients flow to scores (not to the counts).

    Under `jit` with the tokens sharded over mesh axes, each device computes its tokens' share
    (with per-sequence counts, its own sequences': B must divide into the shards, else the
    tokens are gathered) and the shares are summed: the one-device loss, up to float32
    summation order.
    """
    fn = "load_balancing_loss"
    scores = jnp.asarray(scores)
    tokens_per_expert = jnp.asarray(tokens_per_expert)
    _ffi.check_rank(fn, "scores", scores, 2, "[T, E]")
    _ffi.check_float(fn, "scores", scores)
    if tokens_per_expert.ndim not in (1, 2):
        raise ValueError(f"{fn}: tokens_per_expert must be [E] or [B, E], got shape "
                         f"{tuple(tokens_per_expert.shape)}")
    per_sequence = tokens_per_expert.ndim == 2
    if per_sequence and total_tokens is not None:
        raise ValueError(f"{fn}: total_tokens = {total_tokens} with per-sequence counts "
                         f"{tuple(tokens_per_expert.shape)}: each sequence is its own batch")
    k = _ffi.int_arg(fn, "k", k, 1)
    coeff = _ffi.float_arg(fn, "coeff", coeff)
    if total_tokens is not None:
        total_tokens = _ffi.int_arg(fn, "total_tokens", total_tokens, 0, 2**63 - 1)
    attrs = (("k", np.int32(k)), ("coeff", np.float32(coeff)),
             ("total_tokens", np.int64(total_tokens or 0)),
             ("per_sequence", np.bool_(per_sequence)))
    return _balance(scores, _ffi.as_int32(fn, "tokens_per_expert", tokens_per_expert), attrs)


def _z_body(logits, *, split, coeff):
    cuda = _ffi.Cuda(workspace=_ffi.cuda_router_workspace_bytes(*logits.shape))
    loss = _ffi.call("moekit_z_loss_fwd", ((), jnp.float32), logits, cuda=cuda, coeff=coeff)
    return [split.mean(loss)]


def _z_bwd_body(logits, d_loss, *, split, coeff):
    return [_ffi.call("moekit_z_loss_bwd", (logits.shape, logits.dtype), logits,
                      split.share(d_loss), cuda=_unit_cotangent(logits.shape, logits.dtype),
                      coeff=coeff)]


_Z_FWD = ts.token_primitive(ts.TokenOp("moekit_z_loss_fwd", _z_body, (("t", "e"),), ((),)))
_Z_BWD = ts.token_primitive(ts.TokenOp("moekit_z_loss_bwd", _z_bwd_body, (("t", "e"), ()),
                                       (("t", "e"),)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _z(logits, coeff):
    return ts.bind(_Z_FWD, logits, coeff=coeff)[0]


def _z_fwd(logits, coeff):
    return _z(logits, coeff), logits


def _z_bwd(coeff, logits, d_loss):
    d_logits, = ts.bind(_Z_BWD, logits, d_loss.astype(jnp.float32), coeff=coeff)
    return _ffi.match_vma((d_logits,), (logits,))


_z.defvjp(_z_fwd, _z_bwd)


def z_loss(logits, coeff=1.0):
    """The router z-loss, ``coeff * mean_t(logsumexp(logits[t])^2)`` (0 for no tokens).

    Args:
      logits: ``[T, E]`` float32 or bfloat16.

    Returns:
      a float32 scalar; gradients flow to logits. Under a sharded `jit`, each device's tokens'
      mean, averaged over the devices (the one-device loss up to float32 summation order).
    """
    logits = jnp.asarray(logits)
    _ffi.check_rank("z_loss", "logits", logits, 2, "[T, E]")
    _ffi.check_float("z_loss", "logits", logits)
    return _z(logits, np.float32(_ffi.float_arg("z_loss", "coeff", coeff)))


def count_tokens_per_expert(routing_map, num_sequences=None):
    """How many tokens chose each expert: the column sums of a routing map (the C++
    `count_tokens_per_expert`), the counts `load_balancing_loss` and `update_expert_bias` take.

    Args:
      routing_map: ``[T, E]`` bool (`route`'s, or `aux_loss_scores`').
      num_sequences: None: the counts of all T tokens, ``[E]``; B: the counts of each of B
        sequences, ``[B, E]`` (tokens batch-major, B divides T), for the per-sequence
        load-balancing loss.

    Returns:
      int32 ``[E]`` or ``[B, E]`` (integers: no gradient). Under `jit` with the tokens sharded,
      each device counts its own tokens (per sequence: its own sequences, B dividing over the
      devices), the batch's counts summed over them.
    """
    fn = "count_tokens_per_expert"
    routing_map = jnp.asarray(routing_map)
    _ffi.check_rank(fn, "routing_map", routing_map, 2, "[T, E] bool")
    if routing_map.dtype != jnp.bool_:
        raise TypeError(f"{fn}: routing_map dtype {routing_map.dtype} is not bool")
    T, E = routing_map.shape
    if num_sequences is None:
        return ts.bind(_COUNT_BATCH, routing_map)[0]
    B = _ffi.int_arg(fn, "num_sequences", num_sequences, 1)
    if T % B:
        raise ValueError(f"{fn}: num_sequences = {B}: must divide the {T} tokens")
    return ts.bind(_COUNT_SEQUENCES, routing_map.reshape(B, T // B, E))[0]


def _count_batch_body(routing_map, *, split):
    counts = _ffi.call("moekit_count_tokens_per_expert", ((routing_map.shape[1],), jnp.int32),
                       routing_map, cuda=_ffi.Cuda())
    return [split.sum(counts)]  # the batch's: the sum of the pieces'


def _count_sequences_body(routing_map, *, split):
    B, S, E = routing_map.shape  # each piece counts its own sequences
    return [_ffi.call("moekit_count_tokens_per_expert", ((B, E), jnp.int32),
                      routing_map.reshape(B * S, E), cuda=_ffi.Cuda())]


_COUNT_BATCH = ts.token_primitive(ts.TokenOp("moekit_count_tokens_per_expert", _count_batch_body,
                                             (("t", "e"),), (("e",),)))
_COUNT_SEQUENCES = ts.token_primitive(ts.TokenOp(
    "moekit_count_tokens_per_sequence", _count_sequences_body, (("seq", "s", "e"),),
    (("seq", "e"),)))


def update_expert_bias(expert_bias, tokens_per_expert, rate):
    """The loss-free balancing step (DeepSeek-V3; the C++ `update_expert_bias`):
    ``expert_bias[e] + rate * sign(mean(tokens_per_expert) - tokens_per_expert[e])``, sign(0) = 0:
    an expert chosen less than the mean is raised, one chosen more is lowered.

    Args:
      expert_bias: ``[E]`` float32, the bias `route` adds to the selection scores.
      tokens_per_expert: ``[E]`` integer counts of the batch (`count_tokens_per_expert`, or
        `moe_layer`'s ``MoeAux.tokens_per_expert``).
      rate: the update's step, finite.

    Returns:
      the new ``[E]`` float32 bias. The call writes it in the argument's buffer: in place where the
      bias is donated (`jax.jit(..., donate_argnums=...)`) or dead after the call, else XLA copies
      it first. Not differentiated.
    """
    fn = "update_expert_bias"
    expert_bias = jnp.asarray(expert_bias)
    _ffi.check_rank(fn, "expert_bias", expert_bias, 1, "[E] float32")
    if expert_bias.dtype != jnp.float32:
        raise TypeError(f"{fn}: expert_bias dtype {expert_bias.dtype} is not float32")
    tokens_per_expert = jnp.asarray(tokens_per_expert)
    _ffi.check_int_vector(fn, "tokens_per_expert", tokens_per_expert)
    if tokens_per_expert.shape != expert_bias.shape:
        raise ValueError(f"{fn}: tokens_per_expert {tuple(tokens_per_expert.shape)} and "
                         f"expert_bias {tuple(expert_bias.shape)} must both be [E]")
    rate = np.float32(_ffi.float_arg(fn, "rate", rate))
    return _ffi.call("moekit_update_expert_bias", (expert_bias.shape, jnp.float32),
                     _ffi.as_int32(fn, "tokens_per_expert", tokens_per_expert),
                     jax.lax.stop_gradient(expert_bias), aliases={1: 0}, cuda=_ffi.Cuda(),
                     rate=rate)
