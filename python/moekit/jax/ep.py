"""Expert parallelism under `jax.shard_map` (SPEC.md section 4): each device's rows to the
device holding their expert, regrouped by local expert, and back.

The exchange is XLA's, one of two forms:

- `dispatch` / `combine`, for any backend (XLA:CPU has no ragged all-to-all): a
  `jax.lax.all_to_all` of equal blocks, one per peer, each `capacity` rows long and filled as
  far as the routing needs. moekit's C++ kernels lay the rows out on either side (`pack`,
  `regroup`, `ungroup`, `unpack`; each pair is the other's gradient).
- `dispatch_ragged` / `combine_ragged`, for backends that lower `jax.lax.ragged_all_to_all`
  (GPU, TPU): one chunk per (peer, expert), each written straight into its regrouped place on
  the receiver, so only the routed rows move and no layout pass is needed. Their gradients are
  JAX's own (the primitive's transpose is the return trip).

Either way the grouped matmuls never compute the rows past those received.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moekit.jax import _ffi

__all__ = ["Exchange", "RaggedExchange", "block_rows", "combine", "combine_ragged", "dispatch",
           "dispatch_ragged", "pack", "regroup", "ungroup", "unpack"]


def _layout(name, x, counts, shape):
    return _ffi.call(name, (shape, x.dtype), x, counts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def pack(x_perm, tokens_per_expert, num_ranks, capacity):
    """``[N, H] -> [P, C, H]``: block q holds the rows of device q's experts (E / P of the
    `tokens_per_expert` [E], in order), then zero rows. A peer's rows beyond C is an error."""
    return _layout("moekit_ep_pack", x_perm, tokens_per_expert,
                   (num_ranks, capacity, x_perm.shape[1]))


def _pack_fwd(x_perm, tokens_per_expert, num_ranks, capacity):
    return pack(x_perm, tokens_per_expert, num_ranks, capacity), (tokens_per_expert,
                                                                  x_perm.shape[0])


def _pack_bwd(num_ranks, capacity, res, ct):
    tokens_per_expert, rows = res
    return unpack(ct, tokens_per_expert, rows), None


pack.defvjp(_pack_fwd, _pack_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def unpack(blocks, tokens_per_expert, rows):
    """The inverse of `pack`: ``[P, C, H] -> [rows, H]``; rows past the routed ones are 0."""
    return _layout("moekit_ep_unpack", blocks, tokens_per_expert, (rows, blocks.shape[2]))


def _unpack_fwd(blocks, tokens_per_expert, rows):
    return unpack(blocks, tokens_per_expert, rows), (tokens_per_expert, blocks.shape[:2])


def _unpack_bwd(rows, res, ct):
    tokens_per_expert, (num_ranks, capacity) = res
    return pack(ct, tokens_per_expert, num_ranks, capacity), None


unpack.defvjp(_unpack_fwd, _unpack_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def regroup(recv, recv_tokens_per_expert, rows):
    """``[P, C, H] -> [rows, H]``: block q holds source q's rows for local expert 0, 1, ...
    (`recv_tokens_per_expert` [P, E_loc]); the result holds local expert 0's rows from every
    source in source order, then local expert 1's, ..., then zero rows."""
    return _layout("moekit_ep_regroup", recv, recv_tokens_per_expert, (rows, recv.shape[2]))


def _regroup_fwd(recv, recv_tokens_per_expert, rows):
    return regroup(recv, recv_tokens_per_expert, rows), (recv_tokens_per_expert, recv.shape[:2])


def _regroup_bwd(rows, res, ct):
    recv_tokens_per_expert, (num_ranks, capacity) = res
    return ungroup(ct, recv_tokens_per_expert, num_ranks, capacity), None


regroup.defvjp(_regroup_fwd, _regroup_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def ungroup(x_local, recv_tokens_per_expert, num_ranks, capacity):
    """The inverse of `regroup`: ``[rows, H] -> [P, C, H]``, unused rows 0."""
    return _layout("moekit_ep_ungroup", x_local, recv_tokens_per_expert,
                   (num_ranks, capacity, x_local.shape[1]))


def _ungroup_fwd(x_local, recv_tokens_per_expert, num_ranks, capacity):
    return (ungroup(x_local, recv_tokens_per_expert, num_ranks, capacity),
            (recv_tokens_per_expert, x_local.shape[0]))


def _ungroup_bwd(num_ranks, capacity, res, ct):
    recv_tokens_per_expert, rows = res
    return regroup(ct, recv_tokens_per_expert, rows), None


ungroup.defvjp(_ungroup_fwd, _ungroup_bwd)


def block_rows(tokens, num_experts, num_ranks, k, *, rows, capacity_factor=None, align_size=None,
               pad_to_capacity=False):
    """The rows C of one block: the most one device can send one peer. Dropless that is all of
    its `rows` (permute's N_out: every row may go to one peer's experts); with a capacity, at most
    E_loc experts of capacity rows each (the capacity as permute computes it, aligned)."""
    fn = "block_rows"
    tokens, rows = _ffi.int_arg(fn, "tokens", tokens, 0), _ffi.int_arg(fn, "rows", rows, 0)
    num_experts = _ffi.int_arg(fn, "num_experts", num_experts, 1)
    num_ranks = _ffi.int_arg(fn, "num_ranks", num_ranks, 1, num_experts, "[1, num_experts]")
    k = _ffi.int_arg(fn, "k", k, 1, num_experts, "[1, num_experts]")
    if capacity_factor is None:
        return rows
    capacity_factor = _ffi.float_arg(fn, "capacity_factor", capacity_factor, positive=True,
                                     f32=False)
    a = 1 if align_size is None else _ffi.int_arg(fn, "align_size", align_size, 1)
    # (Bounded: a capacity past every row keeps every slot, and ceil(inf) would raise.)
    capacity = math.ceil(min(float(tokens) * k / num_experts * capacity_factor, 2.0**62))
    per_expert = -(-capacity // a) * a
    per_peer = (num_experts // num_ranks) * per_expert
    return per_peer if pad_to_capacity else min(rows, per_peer)


class Exchange(NamedTuple):
    """What `dispatch` learnt, for `combine`: the counts on both sides and the block size."""
    tokens_per_expert: jax.Array       # [E] int32: this device's rows per expert (sent)
    recv_tokens_per_expert: jax.Array  # [P, E_loc] int32: rows from source q for local expert j
    local_tokens_per_expert: jax.Array  # [E_loc] int32: the local experts' group sizes
    rows: int                          # N: rows of this device's permuted buffer
    capacity: int                      # C: rows of one block


def dispatch(x_perm, tokens_per_expert, axis_name, *, capacity):
    """Sends each expert's rows to the device holding it, along `axis_name` (device i holds
    experts i*E_loc .. (i+1)*E_loc - 1), and regroups what arrives by local expert.

    Args:
      x_perm: ``[N, H]`` this device's rows, expert-major (permute's output).
      tokens_per_expert: ``[E]`` int32, E = P * E_loc.
      axis_name: the mesh axis of the experts.
      capacity: C, the rows of one block (`block_rows`).

    Returns:
      ``(x_local [P * C, H], Exchange)``: the local experts' rows, local-expert-major, each
      expert's rows in source order, then zero rows; ``Exchange.local_tokens_per_expert`` are
      ragged_dot's group sizes for the local weights.
    """
    capacity = _ffi.int_arg("dispatch", "capacity", capacity, 0)
    num_ranks = jax.lax.axis_size(axis_name)
    E = tokens_per_expert.shape[0]
    if E % num_ranks:
        raise ValueError(f"dispatch: {E} experts do not divide over the {num_ranks} devices of "
                         f"axis {axis_name!r}")
    # One exchange of counts: row q of the result is what device q sends each local expert.
    recv_counts = jax.lax.all_to_all(tokens_per_expert.reshape(num_ranks, E // num_ranks),
                                     axis_name, 0, 0, tiled=True)
    blocks = pack(x_perm, tokens_per_expert, num_ranks, capacity)
    recv = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)
    x_local = regroup(recv, recv_counts, num_ranks * capacity)
    return x_local, Exchange(tokens_per_expert, recv_counts,
                             jnp.sum(recv_counts, axis=0, dtype=jnp.int32), x_perm.shape[0],
                             capacity)


def combine(y_local, exchange, axis_name):
    """The inverse of `dispatch`: ``y_local [P * C, H]`` (in x_local's order) back to the
    devices the rows came from, as ``y_perm [N, H]`` in x_perm's order."""
    num_ranks = jax.lax.axis_size(axis_name)
    back = ungroup(y_local, exchange.recv_tokens_per_expert, num_ranks, exchange.capacity)
    ret = jax.lax.all_to_all(back, axis_name, 0, 0, tiled=True)
    return unpack(ret, exchange.tokens_per_expert, exchange.rows)


def _starts(sizes, axis=-1):
    """Exclusive prefix sums: where each of `sizes`' chunks starts when laid end to end."""
    return jnp.cumsum(sizes, axis=axis, dtype=jnp.int32) - sizes


class RaggedExchange(NamedTuple):
    """What `dispatch_ragged` learnt, for `combine_ragged`. E = P * E_loc."""
    tokens_per_expert: jax.Array        # [E] int32: this device's rows per expert (sent)
    recv_tokens_per_expert: jax.Array   # [P, E_loc] int32: rows from source q for local expert j
    recv_starts: jax.Array              # [P, E_loc] int32: where those rows lie in x_local
    return_starts: jax.Array            # [P, E_loc] int32: where they go back to in q's x_perm
    local_tokens_per_expert: jax.Array  # [E_loc] int32: the local experts' group sizes
    rows: int                           # N: rows of this device's permuted buffer


def dispatch_ragged(x_perm, tokens_per_expert, axis_name, *, capacity):
    """`dispatch` by one `jax.lax.ragged_all_to_all`, for backends that lower it (not XLA:CPU,
    whose compiler refuses the program). The same arguments and the same ``x_local``; only the
    routed rows move.

    Chunk e of the E sent is expert e's rows (``x_perm`` is expert-major), for device
    ``e // E_loc``; the receiver has told each source, by an `all_to_all` of offsets, where in
    its x_local that chunk goes: local expert j's rows from source 0, then from source 1, ...
    after the rows of local experts before j, as `dispatch` lays them out. The gradient is JAX's
    transpose of the primitive.

    Returns:
      ``(x_local [P * C, H], RaggedExchange)``.
    """
    capacity = _ffi.int_arg("dispatch_ragged", "capacity", capacity, 0)
    num_ranks = jax.lax.axis_size(axis_name)
    E = tokens_per_expert.shape[0]
    if E % num_ranks:
        raise ValueError(f"dispatch_ragged: {E} experts do not divide over the {num_ranks} "
                         f"devices of axis {axis_name!r}")
    tokens_per_expert = tokens_per_expert.astype(jnp.int32)
    recv_counts = jax.lax.all_to_all(tokens_per_expert.reshape(num_ranks, E // num_ranks),
                                     axis_name, 0, 0, tiled=True)  # [P, E_loc]
    local = jnp.sum(recv_counts, axis=0, dtype=jnp.int32)  # [E_loc]
    recv_starts = _starts(local)[None, :] + _starts(recv_counts, axis=0)  # [P, E_loc]
    send_starts = _starts(tokens_per_expert)  # [E]: expert e's rows in x_perm
    # Row q: where this device's chunks for q's experts go on q; where they come back to here.
    land_at = jax.lax.all_to_all(recv_starts, axis_name, 0, 0, tiled=True).reshape(E)
    return_starts = jax.lax.all_to_all(send_starts.reshape(num_ranks, E // num_ranks),
                                       axis_name, 0, 0, tiled=True)
    out = jnp.zeros((num_ranks * capacity, x_perm.shape[1]), x_perm.dtype)
    x_local = jax.lax.ragged_all_to_all(x_perm, out, send_starts, tokens_per_expert, land_at,
                                        recv_counts.reshape(E), axis_name=axis_name)
    return x_local, RaggedExchange(tokens_per_expert, recv_counts, recv_starts, return_starts,
                                   local, x_perm.shape[0])


def combine_ragged(y_local, exchange, axis_name):
    """The inverse of `dispatch_ragged`: ``y_local [P * C, H]`` (in x_local's order) back to the
    devices the rows came from, as ``y_perm [N, H]`` in x_perm's order, rows past the routed
    ones 0. One `jax.lax.ragged_all_to_all`, chunk (q, j) from its place in y_local to source q."""
    E = exchange.tokens_per_expert.shape[0]
    out = jnp.zeros((exchange.rows, y_local.shape[1]), y_local.dtype)
    return jax.lax.ragged_all_to_all(
        y_local, out, exchange.recv_starts.reshape(E),
        exchange.recv_tokens_per_expert.reshape(E), exchange.return_starts.reshape(E),
        exchange.tokens_per_expert, axis_name=axis_name)
