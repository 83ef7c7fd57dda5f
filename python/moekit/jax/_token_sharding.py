"""Ops that work token by token, split over the mesh by their tokens under a sharded `jit`.

A handler call is opaque to XLA: under `jit` with tokens sharded over mesh axes, XLA would gather
every operand onto every device and run the whole call on each. A `TokenOp` is instead a JAX
primitive whose lowering is a `custom_partitioning` (as ragged_dot's kernels): Shardy propagates
shardings through it by an einsum-like rule, and `_partition` keeps the token dimension split
over the axes an operand has it on, every other dimension whole. Each device then runs the op on
its own tokens; where a result sums over the tokens (a loss, the counts per expert, a weight
gradient), the op's body adds the devices' shares itself (`Split.sum`), so that every result is
the one-device result. Outside a multi-device `jit` (one device, or inside `shard_map`, where the
caller has split the tokens already) the body runs on all the tokens it is given.

Factors: "t" is the token dimension (and "seq", sequences of tokens, split with it: the
per-sequence counts of the load-balancing loss); every other factor stays whole. The tokens are
split only when every token dimension divides by the number of pieces; else they are gathered
(correct, and what XLA would do).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax._src import dispatch
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec as P

from moekit.jax import _ffi

TOKEN_FACTORS = ("t", "seq")


class Split(NamedTuple):
    """How the tokens are split where an op's body runs: over the mesh axes `axes` (a tuple,
    empty: not split) into `count` equal pieces, this device's the `index()`-th."""
    axes: tuple = ()
    count: int = 1

    def index(self):
        return jax.lax.axis_index(self.axes) if self.axes else jnp.int32(0)

    def sum(self, v):
        """v summed over the pieces (the whole batch's value from each device's share)."""
        return jax.lax.psum(v, self.axes) if self.axes else v

    def mean(self, v):
        """The mean of the pieces' v (a mean over the batch from the pieces' means)."""
        return self.sum(v) / self.count if self.count > 1 else v

    def share(self, d):
        """A piece's share of a mean's cotangent d (mean's transpose)."""
        return d / self.count if self.count > 1 else d


WHOLE = Split()


class TokenOp(NamedTuple):
    """An op for `token_primitive`.

    body: body(*operands, split=Split, **params) -> list of results: the op on the tokens it is
      given (a device's piece, or all of them with WHOLE), the tokens' shares summed where a
      result is a sum over the tokens.
    operands, results: each operand's and result's factors, one per dimension: "t" the tokens,
      "seq" sequences of tokens, any other name (or None) a dimension kept whole; or None for an
      array kept whole of any rank. E.g. (("t", "e"), None) for logits [T, E] and a bias.
    """
    name: str
    body: Callable
    operands: tuple
    results: tuple


def _resolve(mappings, ranks, prefix):
    """Each mapping as a tuple of factor names for an array of the given rank: None (a whole
    array, or a whole dimension) named uniquely."""
    out = []
    for i, (m, rank) in enumerate(zip(mappings, ranks)):
        m = (None,) * rank if m is None else m
        out.append(tuple(f if f is not None else f"{prefix}{i}_{d}" for d, f in enumerate(m)))
    return out


def _rule(op, mesh, operand_types, result_types):
    """The Shardy rule (the sharding_rule callable of custom_partitioning): the token factors
    shared, every other factor whole; the tokens a reduction factor where no result has them."""
    rank = lambda t: mlir.ir.ShapedType(t).rank  # noqa: E731
    operands = _resolve(op.operands, [rank(t) for t in operand_types], "a")
    results = _resolve(op.results, [rank(t) for t in result_types], "r")

    def side(mappings):
        return ", ".join(" ".join(m) for m in mappings)
    order = [f for m in operands + results for f in m]
    whole = tuple(dict.fromkeys(f for f in order if f not in TOKEN_FACTORS))
    in_results = {f for m in results for f in m}
    reduced = tuple(f for f in dict.fromkeys(order) if f in TOKEN_FACTORS and f not in in_results)
    return f"{side(operands)} -> {side(results)}", dict(need_replication_factors=whole,
                                                        reduction_factors=reduced)


def _axes(sharding, ndim, dim):
    """The mesh axes dimension `dim` is split over, as a tuple (empty: not split)."""
    if not isinstance(sharding, NamedSharding):
        return ()
    spec = tuple(sharding.spec) + (None,) * ndim
    axes = spec[dim]
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def split_of(mappings, shapes, mesh):
    """The Split the operands' and results' shardings give (shapes: objects with .shape and
    .sharding; mappings resolved to their ranks): the axes of the first token dimension that is
    split, if every token dimension divides by their size; else WHOLE."""
    axes = ()
    for factors, x in zip(mappings, shapes):
        for d, f in enumerate(factors):
            if f in TOKEN_FACTORS and not axes:
                axes = _axes(getattr(x, "sharding", None), len(factors), d)
    count = math.prod(mesh.shape[a] for a in axes)
    sizes = [x.shape[d] for factors, x in zip(mappings, shapes)
             for d, f in enumerate(factors) if f in TOKEN_FACTORS]
    if count <= 1 or any(s % count for s in sizes):
        return WHOLE
    return Split(axes, count)


def _partition(op, params, mesh, arg_shapes, result_shape):
    operands = _resolve(op.operands, [len(x.shape) for x in arg_shapes], "a")
    results = _resolve(op.results, [len(x.shape) for x in result_shape], "r")
    # The operands' shardings choose the axes; every token dimension, the results' too, must
    # divide by their size.
    split = split_of(operands + results, tuple(arg_shapes) + tuple(result_shape), mesh)

    def spec(factors):
        return NamedSharding(mesh, P(*((split.axes or None) if f in TOKEN_FACTORS else None
                                       for f in factors)))

    def lower_fn(*args):
        return tuple(op.body(*args, split=split, **dict(params)))

    return (mesh, lower_fn, tuple(spec(m) for m in results), tuple(spec(m) for m in operands))


@functools.cache
def _partitioned(op, params):
    fn = custom_partitioning(lambda *args: tuple(op.body(*args, split=WHOLE, **dict(params))))
    fn.def_partition(functools.partial(_partition, op, params),
                     sharding_rule=functools.partial(_rule, op))
    return fn


def token_primitive(op):
    """`op` as a JAX primitive with multiple results: bind(*operands, params=((name, value),
    ...)) with hashable values. It runs the body on all tokens, lowers through the partitioning
    above, and under vmap runs a loop of calls."""
    p = Primitive(op.name)
    p.multiple_results = True

    def impl(*args, params):
        return list(op.body(*args, split=WHOLE, **dict(params)))

    def abstract_eval(*avals, params):
        structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
        out = jax.eval_shape(lambda *a: list(op.body(*a, split=WHOLE, **dict(params))),
                             *structs)
        typed = _ffi.varying_type(avals)
        return [jax.core.ShapedArray(o.shape, o.dtype, **typed) for o in out]

    def lower(ctx, *args, params):
        return mlir.lower_fun(_partitioned(op, params), multiple_results=True)(ctx, *args)

    def batch(args, dims, *, params):
        size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
        moved = tuple(jnp.moveaxis(x, d, 0) if d is not None else
                      jnp.broadcast_to(x, (size,) + x.shape) for x, d in zip(args, dims))
        out = jax.lax.map(lambda xs: p.bind(*xs, params=params), moved)
        return out, [0] * len(out)

    p.def_impl(impl)
    p.def_abstract_eval(abstract_eval)
    mlir.register_lowering(p, lower)
    batching.primitive_batchers[p] = batch
    # custom_partitioning needs the devices when the call is lowered (see ragged_dot.py).
    dispatch.prim_requires_devices_during_lowering.add(p)
    return p


def bind(p, *args, **params):
    """The primitive's results for `args`, with params as keywords (values hashable)."""
    return p.bind(*args, params=tuple(sorted(params.items())))
