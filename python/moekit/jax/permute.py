"""Permutation between token order and expert-major order, and back (SPEC.md section 3), each
with its C++ backward."""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from moekit.jax import _ffi

__all__ = ["Permuted", "permute", "sort_chunks_by_index", "unpermute"]

_DROP_POLICIES = {"probs": 0, "position": 1}  # DropPolicy's values in include/moekit/permute.h


class Permuted(NamedTuple):
    """permute's outputs. T tokens, E experts, S slots per token (k, or E beside a routing map),
    N_out rows of the permuted buffer."""
    x: jax.Array                  # [N_out, H]: expert e's rows form block e, then zero rows
    probs: Optional[jax.Array]    # [N_out] the probs of each row, or None when none were given
    tokens_per_expert: jax.Array  # [E] int32: rows of each expert's block, padding included
    row_map: jax.Array            # [2, T, S] int32: row of slot (t, s) (-1: none), its expert
    pad_offsets: jax.Array        # [E] int32: padding rows before each expert's block


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _permute(x, routing, probs, num_rows, num_experts, attrs):
    has_probs = dict(attrs)["has_probs"]
    (T, H), S = x.shape, routing.shape[1]
    shapes = [((num_rows, H), x.dtype),
              ((num_rows,), probs.dtype) if has_probs else ((0,), jnp.float32),
              ((num_experts,), jnp.int32), ((2, T, S), jnp.int32), ((num_experts,), jnp.int32)]
    cuda = _ffi.Cuda(workspace=_ffi.cuda_permute_workspace_bytes(T, S, num_experts, num_rows))
    out = _ffi.call("moekit_permute_fwd", shapes, x, routing, probs, cuda=cuda, **dict(attrs))
    return Permuted(out[0], out[1] if has_probs else None, out[2], out[3], out[4])


def _permute_fwd(x, routing, probs, num_rows, num_experts, attrs):
    out = _permute(x, routing, probs, num_rows, num_experts, attrs)
    return out, (out.row_map, x, probs)


def _permute_bwd(num_rows, num_experts, attrs, residuals, ct):
    row_map, x, probs = residuals
    has_probs = dict(attrs)["has_probs"]
    results = [(x.shape, x.dtype), (probs.shape, probs.dtype)]
    d_x, d_probs = _ffi.call("moekit_permute_bwd", results, ct.x.astype(x.dtype),
                             ct.probs if has_probs else _ffi.placeholder(), row_map,
                             cuda=_ffi.Cuda(), has_probs=np.bool_(has_probs))
    d_x, d_probs = _ffi.match_vma((d_x, d_probs), (x, probs))
    return d_x, None, d_probs


_permute.defvjp(_permute_fwd, _permute_bwd)


def permute(x, routing_map, probs=None, *, num_experts=None, k=None, align_size=None,
            num_out_tokens=None, capacity_factor=None, drop_policy="probs",
            pad_to_capacity=False):
    """Rows of x into expert-major order (SPEC.md section 3).

    Expert e's block of rows starts after the blocks before it and holds its kept slots in
    (token, slot) order, then zero padding rows up to a multiple of align_size. Rows past the
    last block are zero.

    Args:
      x: ``[T, H]`` float32 or bfloat16.
      routing_map: ``[T, E]`` bool (slot s of token t is expert s, used where True), or
        ``[T, k]`` int32 top-k indices (slot s goes to expert routing_map[t, s]; then
        num_experts is required).
      probs: ``[T, S]`` float32 or bfloat16 (S = E beside a map, k beside indices), or None;
        moved alongside the rows.
      k: experts per token; needed beside a map for a capacity, or to size N_out.
      align_size: pad each expert's block to a multiple of this (None: 1).
      num_out_tokens: N_out, the rows of the result (None: the most any routing can need,
        `permute_max_rows`). Too few for the routing is a run-time error.
      capacity_factor: None (dropless) or > 0: each expert keeps at most
        ``ceil(T * k / E * capacity_factor)`` slots, chosen by drop_policy ("probs": the highest
        probs; "position": the earliest tokens).
      pad_to_capacity: with a capacity, every block is exactly the capacity rows.

    Returns:
      `Permuted(x, probs, tokens_per_expert, row_map, pad_offsets)`, for `unpermute`.

    Gradients flow to x and probs (the C++ permute_backward).

    Under `jit` with the tokens sharded over a mesh, permute keeps its one-device
    result: the rows are laid out across all tokens, so XLA gathers them first. To work
    on each device's own tokens, call it inside `jax.shard_map` (as `moe_layer` does with
    ep_axis), or use `moe_layer`, which runs on each device's tokens under a sharded jit.
    """
    fn = "permute"
    x, routing_map = jnp.asarray(x), jnp.asarray(routing_map)
    _ffi.check_rank(fn, "x", x, 2, "[T, H]")
    _ffi.check_float(fn, "x", x)
    _ffi.check_rank(fn, "routing_map", routing_map, 2, "[T, E] bool or [T, k] int32")
    T, H = x.shape
    if routing_map.shape[0] != T:
        raise ValueError(f"{fn}: routing_map has {routing_map.shape[0]} rows, x has {T}")
    if k is not None:
        k = _ffi.int_arg(fn, "k", k, 1)
    pad_to_capacity = _ffi.bool_arg(fn, "pad_to_capacity", pad_to_capacity)
    if routing_map.dtype == jnp.bool_:
        E = routing_map.shape[1]
        if num_experts is not None and _ffi.int_arg(fn, "num_experts", num_experts, 1) != E:
            raise ValueError(f"{fn}: num_experts = {num_experts} differs from the routing map's "
                             f"E = {E}")
    elif jnp.issubdtype(routing_map.dtype, jnp.integer):
        if num_experts is None:
            raise ValueError(f"{fn}: num_experts is needed beside [T, k] indices")
        E = _ffi.int_arg(fn, "num_experts", num_experts, 1)
        if k is not None and k != routing_map.shape[1]:
            raise ValueError(f"{fn}: k = {k} differs from the indices' k = "
                             f"{routing_map.shape[1]}")
        k = routing_map.shape[1]
        routing_map = _ffi.as_int32(fn, "routing_map", routing_map)
    else:
        raise TypeError(f"{fn}: routing_map dtype {routing_map.dtype} is not bool or int32")
    S = routing_map.shape[1]
    if probs is not None:
        probs = jnp.asarray(probs)
        _ffi.check_float(fn, "probs", probs)
        if probs.shape != (T, S):
            raise ValueError(f"{fn}: probs must be [T, S] = [{T}, {S}], got {tuple(probs.shape)}")
    align, cf, policy = capacity_options(fn, align_size, capacity_factor, drop_policy)
    if capacity_factor is not None and k is None:
        raise ValueError(f"{fn}: a capacity_factor beside a routing map needs k")
    if not 1 <= E < 2**31:
        raise ValueError(f"{fn}: {E} experts: must be in [1, 2^31 - 1]")
    if num_out_tokens is not None:
        num_out_tokens = _ffi.int_arg(fn, "num_out_tokens", num_out_tokens, 0)
    else:
        if k is None:
            raise ValueError(f"{fn}: give k or num_out_tokens beside a routing map (N_out would "
                             f"otherwise be T * E = {T * E})")
        num_out_tokens = _ffi.permute_max_rows(T, E, k, align, cf, pad_to_capacity)
        if num_out_tokens < 0:
            raise ValueError(f"{fn}: T = {T}, E = {E}, k = {k}, align_size = {align_size}, "
                             f"capacity_factor = {capacity_factor}, pad_to_capacity = "
                             f"{pad_to_capacity}: invalid, or the permuted rows could exceed "
                             f"2^31 - 1")
    has_probs = probs is not None
    attrs = (("align_size", np.int64(align)), ("capacity_factor", np.float64(cf)),
             ("drop_policy", np.int32(policy)),
             ("pad_to_capacity", np.bool_(pad_to_capacity)), ("k", np.int32(k or 0)),
             ("has_probs", np.bool_(has_probs)))
    return _permute(x, routing_map, probs if has_probs else _ffi.placeholder(),
                    num_out_tokens, E, attrs)


def capacity_options(fn, align_size, capacity_factor, drop_policy):
    """permute's alignment and capacity checked (errors name `fn`): (align_size as an int >= 1,
    capacity_factor as a float, 0 for dropless, DropPolicy's value)."""
    if drop_policy not in _DROP_POLICIES:
        raise ValueError(f"{fn}: drop_policy = {drop_policy!r}: must be one of "
                         f"{sorted(_DROP_POLICIES)}")
    align = 1 if align_size is None else _ffi.int_arg(fn, "align_size", align_size, 1)
    cf = 0.0 if capacity_factor is None else _ffi.float_arg(
        fn, "capacity_factor", capacity_factor, positive=True, f32=False)
    return align, cf, _DROP_POLICIES[drop_policy]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _unpermute(y, row_map, probs, has_probs):
    T = row_map.shape[1]
    return _ffi.call("moekit_unpermute_fwd", ((T, y.shape[1]), y.dtype), y, row_map, probs,
                     cuda=_ffi.Cuda(), has_probs=np.bool_(has_probs))


def _unpermute_fwd(y, row_map, probs, has_probs):
    return _unpermute(y, row_map, probs, has_probs), (y, row_map, probs)


def _unpermute_bwd(has_probs, residuals, d_out):
    y, row_map, probs = residuals
    results = [(y.shape, y.dtype), (probs.shape, jnp.float32)]
    T, S = row_map.shape[1:]
    cuda = _ffi.Cuda(workspace=_ffi.cuda_permute_workspace_bytes(T, S, 0, y.shape[0]))
    d_y, d_probs = _ffi.call("moekit_unpermute_bwd", results, d_out.astype(y.dtype),
                             y if has_probs else _ffi.placeholder(), row_map, probs, cuda=cuda,
                             has_probs=np.bool_(has_probs))
    d_y, d_probs = _ffi.match_vma((d_y, d_probs.astype(probs.dtype)), (y, probs))
    return d_y, None, d_probs


_unpermute.defvjp(_unpermute_fwd, _unpermute_bwd)


def unpermute(y, perm, merging_probs=None):
    """Combine: ``out[t] = sum_s w[t, s] * y[row_map[0, t, s]]`` over the routed slots, summed
    in slot order in float32 (w = merging_probs, or 1).

    Args:
      y: ``[N_out, H]`` float32 or bfloat16, in the order of `perm` (e.g. the experts' outputs).
      perm: the `Permuted` that permute returned (its row_map is used).
      merging_probs: ``[T, S]`` float32 or bfloat16, or None.

    Returns:
      ``[T, H]`` in y's dtype; gradients flow to y and merging_probs.

    Under `jit` with the tokens sharded over a mesh, unpermute keeps its one-device
    result: the rows are laid out across all tokens, so XLA gathers them first. To work
    on each device's own tokens, call it inside `jax.shard_map` (as `moe_layer` does with
    ep_axis), or use `moe_layer`, which runs on each device's tokens under a sharded jit.
    """
    fn = "unpermute"
    y = jnp.asarray(y)
    row_map = jnp.asarray(perm.row_map)
    _ffi.check_rank(fn, "y", y, 2, "[N_out, H]")
    _ffi.check_float(fn, "y", y)
    if row_map.ndim != 3 or row_map.shape[0] != 2:
        raise ValueError(f"{fn}: perm.row_map must be [2, T, S], got {tuple(row_map.shape)}")
    T, S = row_map.shape[1], row_map.shape[2]
    if merging_probs is None:
        return _unpermute(y, row_map, _ffi.placeholder(), False)
    merging_probs = jnp.asarray(merging_probs)
    _ffi.check_float(fn, "merging_probs", merging_probs)
    if merging_probs.shape != (T, S):
        raise ValueError(f"{fn}: merging_probs must be [T, S] = [{T}, {S}], got "
                         f"{tuple(merging_probs.shape)}")
    return _unpermute(y, row_map, merging_probs, True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _sort(x, split_sizes, sorted_index, probs, inverse, has_probs):
    results = [(x.shape, x.dtype), (probs.shape, probs.dtype)]
    cuda = _ffi.Cuda(workspace=_ffi.cuda_permute_workspace_bytes(0, 0, split_sizes.shape[0],
                                                                 x.shape[0]))
    return tuple(_ffi.call("moekit_sort_chunks_by_index", results, x, split_sizes, sorted_index,
                           probs, cuda=cuda, inverse=np.bool_(inverse),
                           has_probs=np.bool_(has_probs)))


def _sort_fwd(x, split_sizes, sorted_index, probs, inverse, has_probs):
    return _sort(x, split_sizes, sorted_index, probs, inverse, has_probs), (split_sizes,
                                                                            sorted_index)


def _sort_bwd(inverse, has_probs, residuals, ct):
    split_sizes, sorted_index = residuals
    d_out, d_probs = ct
    d_x, d_p = _sort(d_out, split_sizes, sorted_index, d_probs, not inverse, has_probs)
    d_x, d_p = _ffi.match_vma((d_x, d_p), (d_out, d_probs))
    return d_x, None, None, d_p


_sort.defvjp(_sort_fwd, _sort_bwd)


def sort_chunks_by_index(x, split_sizes, sorted_index, probs=None, *, inverse=False):
    """Reorders chunks of rows, as after an all-to-all.

    The first ``sum(split_sizes)`` rows of x form C chunks of split_sizes[c] rows; the result
    holds chunk sorted_index[0], then chunk sorted_index[1], ...; rows past the chunks stay in
    place. inverse=True undoes it (and is its gradient).

    Args:
      x: ``[N, H]`` float32 or bfloat16.
      split_sizes: ``[C]`` int32, each >= 0, summing to at most N.
      sorted_index: ``[C]`` int32, a permutation of [0, C).
      probs: ``[N]`` float32 or bfloat16 moved alongside, or None.

    Returns:
      ``[N, H]``, or ``([N, H], [N])`` when probs is given; gradients flow to x and probs.

    Under `jit` with the tokens sharded over a mesh, sort_chunks_by_index keeps its one-device
    result: the rows are laid out across all tokens, so XLA gathers them first. To work
    on each device's own tokens, call it inside `jax.shard_map` (as `moe_layer` does with
    ep_axis), or use `moe_layer`, which runs on each device's tokens under a sharded jit.
    """
    fn = "sort_chunks_by_index"
    x = jnp.asarray(x)
    split_sizes, sorted_index = jnp.asarray(split_sizes), jnp.asarray(sorted_index)
    _ffi.check_rank(fn, "x", x, 2, "[N, H]")
    _ffi.check_float(fn, "x", x)
    _ffi.check_int_vector(fn, "split_sizes", split_sizes)
    _ffi.check_int_vector(fn, "sorted_index", sorted_index)
    if split_sizes.shape != sorted_index.shape:
        raise ValueError(f"{fn}: split_sizes {tuple(split_sizes.shape)} and sorted_index "
                         f"{tuple(sorted_index.shape)} differ in length")
    has_probs = probs is not None
    if has_probs:
        probs = jnp.asarray(probs)
        _ffi.check_float(fn, "probs", probs)
        if probs.shape != (x.shape[0],):
            raise ValueError(f"{fn}: probs must be [N] = [{x.shape[0]}], got "
                             f"{tuple(probs.shape)}")
    out, out_probs = _sort(x, _ffi.as_int32(fn, "split_sizes", split_sizes),
                           _ffi.as_int32(fn, "sorted_index", sorted_index),
                           probs if has_probs else _ffi.placeholder(),
                           _ffi.bool_arg(fn, "inverse", inverse), has_probs)
    return (out, out_probs) if has_probs else out
