"""The row exchange of expert parallelism over MPI: `dispatch` and `combine` as in
`moekit.jax.ep`, moving only the routed rows, for JAX programs run one process per device under
`mpirun`.

XLA's `all_to_all` moves equal blocks, so on a backend without a ragged all-to-all (XLA:CPU)
`moekit.jax.ep` sends every peer a block of its worst-case rows: P times the bytes the routing
needs, dropless. Here the FFI handler itself plans and moves the rows with moekit's MPI engine
(`moekit/ep_mpi.h`: one all-gather of the counts, then point-to-point messages straight into
the regrouped places). The results keep the static worst-case shapes (rows past those received
are 0, never sent or computed).

Use: launch one process per device with ``mpirun -n P python prog.py``; in it
``jax.distributed.initialize()`` (JAX finds Open MPI's environment), the mesh axis built from
``jax.devices()`` in order (device i in process i = MPI rank i), and
``moe_layer(..., ep_axis=..., ep_exchange="mpi")`` inside `jax.shard_map`. MPI is initialised
on the first call (MPI_THREAD_SERIALIZED) unless the program did so (mpi4py), and finalised at
exit if initialised here.

Every call is collective over MPI_COMM_WORLD, in program order: the layer's data dependencies
give that order, and the calls are side-effecting so XLA neither drops nor merges them. Each
call checks on every process that the device's axis index is its MPI rank; that and any bad
argument is an error on every process, not a hang. Needs libmoekit_jax_mpi.so, built where MPI
is found (`available()`).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moekit.jax import _ffi

__all__ = ["LIBRARY", "MpiExchange", "available", "combine", "dispatch", "serves"]

LIBRARY = _ffi.LIBRARY.with_name("libmoekit_jax_mpi.so")


def available():
    """Whether this moekit was built with the MPI exchange (MPI found at build time)."""
    return LIBRARY.exists()


def serves(num_ranks):
    """Whether the MPI exchange can carry an axis of `num_ranks` devices in this program: built,
    this process one of `num_ranks` started by mpirun (Open MPI's or a PMI environment), and
    jax.distributed's processes those, each with one CPU device. `moe_layer`'s
    ep_exchange="auto" takes it then."""
    launched = os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE")
    return (available() and launched is not None and int(launched) == num_ranks
            and jax.process_count() == num_ranks and jax.local_device_count() == 1
            and jax.default_backend() == "cpu")


@functools.lru_cache(maxsize=None)
def _register():
    if not available():
        raise RuntimeError(
            f"moekit.jax.ep_mpi: {LIBRARY} is not built: this moekit was built where no MPI was "
            f"found; install Open MPI (Debian: libopenmpi-dev openmpi-bin) and reinstall moekit")
    # RTLD_GLOBAL: Open MPI's plugins, which it opens itself, look for libmpi's symbols there.
    lib = ctypes.CDLL(str(LIBRARY), mode=ctypes.RTLD_GLOBAL)
    _ffi.register(lib.moekit_ffi_mpi_targets)
    return True


class MpiExchange(NamedTuple):
    """What `dispatch` learnt, for `combine`."""
    tokens_per_expert: jax.Array        # [E] int32: this device's rows per expert (sent)
    local_tokens_per_expert: jax.Array  # [E_loc] int32: the local experts' group sizes
    rows: int                           # N: rows of this device's permuted buffer


def _axis(axis_name):
    num_ranks = jax.lax.axis_size(axis_name)
    return num_ranks, jax.lax.axis_index(axis_name).astype(jnp.int32)


def _dispatch(x_perm, tokens_per_expert, axis_name, rows):
    _register()
    num_ranks, index = _axis(axis_name)
    E = tokens_per_expert.shape[0]
    return _ffi.call("moekit_ep_mpi_dispatch",
                     [((rows, x_perm.shape[1]), x_perm.dtype), ((E // num_ranks,), jnp.int32)],
                     x_perm, tokens_per_expert, index, has_side_effect=True,
                     axis_size=np.int64(num_ranks))


def _combine(y_local, tokens_per_expert, axis_name, rows):
    _register()
    num_ranks, index = _axis(axis_name)
    return _ffi.call("moekit_ep_mpi_combine", ((rows, y_local.shape[1]), y_local.dtype), y_local,
                     tokens_per_expert, index, has_side_effect=True,
                     axis_size=np.int64(num_ranks))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dispatch_rows(x_perm, tokens_per_expert, axis_name, rows):
    return tuple(_dispatch(x_perm, tokens_per_expert, axis_name, rows))


def _dispatch_rows_fwd(x_perm, tokens_per_expert, axis_name, rows):
    return (_dispatch_rows(x_perm, tokens_per_expert, axis_name, rows),
            (tokens_per_expert, x_perm.shape[0]))


def _dispatch_rows_bwd(axis_name, rows, res, ct):
    tokens_per_expert, n = res
    return _combine_rows(ct[0], tokens_per_expert, axis_name, n), None


_dispatch_rows.defvjp(_dispatch_rows_fwd, _dispatch_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _combine_rows(y_local, tokens_per_expert, axis_name, rows):
    return _combine(y_local, tokens_per_expert, axis_name, rows)


def _combine_rows_fwd(y_local, tokens_per_expert, axis_name, rows):
    return (_combine_rows(y_local, tokens_per_expert, axis_name, rows),
            (tokens_per_expert, y_local.shape[0]))


def _combine_rows_bwd(axis_name, rows, res, ct):
    tokens_per_expert, r = res
    return _dispatch(ct, tokens_per_expert, axis_name, r)[0], None


_combine_rows.defvjp(_combine_rows_fwd, _combine_rows_bwd)


def dispatch(x_perm, tokens_per_expert, axis_name, *, capacity):
    """Sends each expert's rows to the process holding it, along `axis_name` (device i, in MPI
    rank i, holds experts i*E_loc .. (i+1)*E_loc - 1), regrouped there by local expert.

    Args:
      x_perm: ``[N, H]`` this device's rows, expert-major (permute's output).
      tokens_per_expert: ``[E]`` int32, E = P * E_loc.
      axis_name: the mesh axis of the experts: one device per MPI process, in rank order.
      capacity: C, the most rows one device sends one peer (`moekit.jax.ep.block_rows`).

    Returns:
      ``(x_local [P * C, H], MpiExchange)``: as `moekit.jax.ep.dispatch` gives them (the local
      experts' rows, local-expert-major, each expert's rows in source order, then zero rows).
      More rows than P * C arriving is an error on every process. Its gradient is `combine`.
    """
    capacity = _ffi.int_arg("ep_mpi.dispatch", "capacity", capacity, 0)
    num_ranks = jax.lax.axis_size(axis_name)
    E = tokens_per_expert.shape[0]
    if E % num_ranks:
        raise ValueError(f"ep_mpi.dispatch: {E} experts do not divide over the {num_ranks} "
                         f"devices of axis {axis_name!r}")
    x_local, local_counts = _dispatch_rows(x_perm, tokens_per_expert, axis_name,
                                           num_ranks * capacity)
    return x_local, MpiExchange(tokens_per_expert, local_counts, x_perm.shape[0])


def combine(y_local, exchange, axis_name):
    """The inverse of `dispatch`: ``y_local [P * C, H]`` (in x_local's order) back to the
    processes the rows came from, as ``y_perm [N, H]`` in x_perm's order (rows past the routed
    ones 0). Its gradient is `dispatch`."""
    return _combine_rows(y_local, exchange.tokens_per_expert, axis_name, exchange.rows)
