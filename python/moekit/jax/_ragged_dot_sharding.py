"""How ragged_dot's three kernels split over a mesh under `jit` with shardings.

Each kernel is wrapped in `custom_partitioning`: Shardy propagates shardings through it by an
einsum-like rule, and the SPMD partitioner then asks `_partition` which shardings to keep and
what each device runs. Outside a multi-device `jit` (one device, or inside a fully manual
`shard_map`) JAX inlines the kernel itself.

The factors (m rows, g local groups, k and n the matrices' other dimensions):
  fwd   a [m, k] x b [g, k, n] -> [m, n]
  dlhs  a [m, n] x b [g, k, n] -> [m, k]
  drhs  a [m, k] x b [m, n]    -> [g, k, n]
(with rhs_transposed, each [g, k, n] is [g, n, k]).
Every factor but g stays sharded. The result's columns (n, or k for dlhs) keep their axes, so a
weight sharded over n for tensor parallelism stays so, forward and backward. The contracted
factor (k, n, m) may be sharded too: each device computes its share in f32 and the shares are
summed (one psum, then rounded to the result dtype), as XLA does for a sharded dot. Rows split
groups: each device runs its rows with the groups' sizes clipped to its row range. The groups,
the group sizes and the offset are replicated; where two factors would take the same mesh axis,
the result's columns, then the contraction, then the rows keep it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

# Each kernel's operands' and result's factors, and its contracted factor.
_FACTORS = {"fwd": ("mk", "gkn", "mn", "k"), "dlhs": ("mn", "gkn", "mk", "n"),
            "drhs": ("mk", "mn", "gkn", "m")}


def _factors(kind, rhs_transposed):
    """_FACTORS[kind], with the weights' [g, k, n] as [g, n, k] where they are stored so."""
    if not rhs_transposed:
        return _FACTORS[kind]
    return tuple("gnk" if f == "gkn" else f for f in _FACTORS[kind])


def _rule(kind, rhs_transposed):
    a, b, out, reduced = _factors(kind, rhs_transposed)
    rule = f"{' '.join(a)}, {' '.join(b)}, s, o -> {' '.join(out)}"
    # Shardy wants the special factors in the order they first appear in the rule.
    replicated = sorted("gso", key=(a + b + "so" + out).index)
    return rule, dict(reduction_factors=(reduced,), need_replication_factors=tuple(replicated))


def _axes(sharding, ndim, dim):
    """The mesh axes dimension `dim` is split over, as a tuple (empty: not split, or a
    sharding that names no axes)."""
    if not isinstance(sharding, NamedSharding):
        return ()
    spec = tuple(sharding.spec)
    spec += (None,) * (ndim - len(spec))
    axes = spec[dim]
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def _local_group_sizes(group_sizes, rows, local_rows):
    """This device's share of the groups: group j's rows clipped to the device's row range. Sizes
    whose total passes the global row count are passed on whole, for the kernel to refuse."""
    lo = jax.lax.axis_index(rows) * local_rows
    end = jnp.cumsum(group_sizes)
    start = end - group_sizes
    local = jnp.clip(end, lo, lo + local_rows) - jnp.clip(start, lo, lo + local_rows)
    too_many = group_sizes.sum() > local_rows * jax.lax.axis_size(rows)
    return jnp.where(too_many, group_sizes, local)


def _partition(impl, kind, out_dtype, num_local, batch_invariant, rhs_transposed, mesh,
               arg_shapes, result_shape):
    a_factors, b_factors, out_factors, reduced = _factors(kind, rhs_transposed)
    operands = ((b_factors, arg_shapes[1]), (a_factors, arg_shapes[0]))  # the weights' first

    def given(f):
        for factors, x in operands:
            if f in factors and (axes := _axes(x.sharding, len(factors), factors.index(f))):
                return axes
        return ()

    taken, chosen = set(), {}
    for f in dict.fromkeys([c for c in out_factors if c not in "mg"] + [reduced, "m"]):
        chosen[f] = tuple(x for x in given(f) if x not in taken)
        taken.update(chosen[f])
    rows, sums = chosen["m"], chosen[reduced]

    def spec(factors):
        return NamedSharding(mesh, P(*(chosen.get(f) or None for f in factors)))

    def kernel(a, b, group_sizes, group_offset, dtype):
        return impl(kind, a, b, group_sizes, group_offset, out_dtype=dtype, num_local=num_local,
                    batch_invariant=batch_invariant, rhs_transposed=rhs_transposed)

    def lower_fn(a, b, group_sizes, group_offset):
        if rows:
            group_sizes = _local_group_sizes(group_sizes, rows, a.shape[0])
        if not sums:
            return kernel(a, b, group_sizes, group_offset, out_dtype)
        share = kernel(a, b, group_sizes, group_offset, np.dtype(jnp.float32))
        return jax.lax.psum(share, sums).astype(out_dtype)

    replicated = NamedSharding(mesh, P())
    return (mesh, lower_fn, spec(out_factors),
            (spec(a_factors), spec(b_factors), replicated, replicated))


@functools.cache
def partitioned(impl, kind, out_dtype, num_local, batch_invariant, rhs_transposed):
    """`impl(kind, a, b, group_sizes, group_offset, out_dtype=, num_local=, batch_invariant=,
    rhs_transposed=)`, the call of one kernel, as a function of its four operands partitioned as
    above (one per parameter set)."""
    fn = custom_partitioning(lambda a, b, s, o: impl(kind, a, b, s, o, out_dtype=out_dtype,
                                                     num_local=num_local,
                                                     batch_invariant=batch_invariant,
                                                     rhs_transposed=rhs_transposed))
    rule, factors = _rule(kind, rhs_transposed)
    fn.def_partition(functools.partial(_partition, impl, kind, out_dtype, num_local,
                                       batch_invariant, rhs_transposed),
                     sharding_rule=rule, **factors)
    return fn
