"""The moekit kernels as JAX functions.

Each function is an XLA FFI call into the C++ kernels, differentiable through `jax.custom_vjp`
whose backward calls the C++ backward kernels (`ragged_dot`: through primitives whose JVPs and
transposes are its three kernels, so also `jvp` and derivatives of any order), and usable under
`jax.jit`, `jax.grad`, `jax.vmap` (a batch runs as a loop of calls) and inside `jax.shard_map`.
The handlers are registered when this package is imported: every function for the CPU platform,
and `ragged_dot` also for the CUDA platform where moekit was built with CUDA (`cuda_built()`), so
that the same code runs on whichever device holds the arrays.

Invalid shapes, dtypes and options raise `ValueError` or `TypeError` at trace time, naming the
argument. Invalid data that only the values show (a negative group size, sizes that sum past the
rows, an offset out of range when it is traced) raise at run time, when the result is computed,
with the C++ library's message (``ragged_dot: group_sizes[3] = -2: ...``). On the CPU, that is;
on a GPU `ragged_dot` keeps the sizes and a traced offset on the device and clamps them instead
(a negative size counts as 0, rows past m drop out, the offset is held in [0, G - E_loc]), so
that a call never waits for the host.

Modules: `ragged_dot` (the grouped matmul), `router` (route, the aux-loss scores, the losses,
the counts per expert and the loss-free bias update), `permute` (permute, unpermute,
sort_chunks_by_index), `layer` (moe_layer, built from the others, and the expert FFN
activation).
"""

from moekit.jax._ffi import cuda_built
from moekit.jax.layer import MoeAux, MoeParams, activation, moe_layer
from moekit.jax.permute import Permuted, permute, sort_chunks_by_index, unpermute
from moekit.jax.ragged_dot import PackedRhs, pack_ragged_rhs, ragged_dot, ragged_dot_general
from moekit.jax.router import (Route, aux_loss_scores, count_tokens_per_expert, load_balancing_loss,
                               route, update_expert_bias, z_loss)

__all__ = [
    "MoeAux", "MoeParams", "PackedRhs", "Permuted", "Route", "activation", "aux_loss_scores",
    "count_tokens_per_expert", "cuda_built", "load_balancing_loss", "moe_layer", "pack_ragged_rhs",
    "permute", "ragged_dot", "ragged_dot_general", "route", "sort_chunks_by_index", "unpermute",
    "update_expert_bias", "z_loss",
]
