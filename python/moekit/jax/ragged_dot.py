"""ragged_dot: the grouped matmul of `jax.lax.ragged_dot` with a working `group_offset`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from moekit.jax import _ffi, _ragged_dot_sharding

__all__ = ["PackedRhs", "pack_ragged_rhs", "ragged_dot", "ragged_dot_general"]

# float16 runs on GPUs only: the CPU handler refuses it at run time, naming the dtype.
_DTYPES = _ffi.FLOAT_DTYPES + (np.dtype(jnp.float16),)


def _call(name, shape, dtype, num_local, attrs, *args):
    """One ragged_dot handler call with a [shape] dtype result, for `num_local` local groups;
    `attrs` the handler's attributes (batch_invariant, rhs_transposed).

    On CUDA the handler also takes its workspace, as a second result that XLA allocates with the
    call's other buffers and that is dropped here: the call allocates nothing, so XLA may capture
    it in a CUDA graph. `platform_dependent` lowers only the branch of the platform compiled for.
    """
    def on_cpu(*a):
        # The CPU kernels take f32 and bf16: float16 is computed in float32 and rounded once.
        if any(x.dtype == jnp.float16 for x in a):
            a = [x.astype(jnp.float32) if x.dtype == jnp.float16 else x for x in a]
            wide = jnp.float32 if np.dtype(dtype) == jnp.float16 else dtype
            return _ffi.call(name, (shape, wide), *a, **attrs).astype(dtype)
        return _ffi.call(name, (shape, dtype), *a, **attrs)

    def on_cuda(*a):
        workspace = ((_ffi.cuda_workspace_bytes(num_local),), np.uint8)
        return _ffi.call(name, [(shape, dtype), workspace], *a, **attrs)[0]

    if not _ffi.cuda_built():
        return on_cpu(*args)
    return jax.lax.platform_dependent(*args, cuda=on_cuda, default=on_cpu)


# The three kernels as JAX primitives, each bilinear in its two float operands (the integer
# group sizes and offset ride along), closed under differentiation: their JVPs are themselves and
# their transposes are each other, so jvp, grad of any order, hessian and linear_transpose all
# reduce to the three C++ kernels.
#   fwd(L, R)   [m, K] x [E, K, n] -> [m, n]: out[rows of j] = L[rows] @ R[j]
#   dlhs(C, R)  [m, n] x [E, K, n] -> [m, K]: out[rows of j] = C[rows] @ R[j]^T
#   drhs(L, C)  [m, K] x [m, n]    -> [E, K, n]: out[j] = L[rows of j]^T @ C[rows of j]
# With rhs_transposed every [E, K, n] above (R, and drhs's result) is stored [E, n, K] instead:
# the kernels read and write that layout themselves, and the transposes keep it.
_TARGETS = {"fwd": "moekit_ragged_dot_fwd", "dlhs": "moekit_ragged_dot_dlhs",
            "drhs": "moekit_ragged_dot_drhs"}
# The transposes: for each kernel, (kernel, operand order) giving its first operand's gradient,
# then its second's, from the cotangent `ct` and the known operand `x`.
_TRANSPOSES = {
    "fwd": (("dlhs", lambda ct, x: (ct, x)), ("drhs", lambda ct, x: (x, ct))),
    "dlhs": (("fwd", lambda ct, x: (ct, x)), ("drhs", lambda ct, x: (ct, x))),
    "drhs": (("dlhs", lambda ct, x: (x, ct)), ("fwd", lambda ct, x: (x, ct))),
}


def _result_shape(kind, a, b, num_local, rhs_transposed):
    k, n = (2, 1) if rhs_transposed else (1, 2)  # where R's K and n lie
    if kind == "fwd":
        return (a.shape[0], b.shape[n])
    if kind == "dlhs":
        return (a.shape[0], b.shape[k])
    if rhs_transposed:  # drhs(L, C) writes [E, n, K]
        return (num_local, b.shape[1], a.shape[1])
    return (num_local, a.shape[1], b.shape[1])


def _impl(kind, a, b, group_sizes, group_offset, *, out_dtype, num_local, batch_invariant,
          rhs_transposed):
    return _call(_TARGETS[kind], _result_shape(kind, a, b, num_local, rhs_transposed), out_dtype,
                 num_local, dict(batch_invariant=batch_invariant, rhs_transposed=rhs_transposed),
                 a, b, group_sizes, group_offset)


def _abstract_eval(kind, a, b, group_sizes, group_offset, *, out_dtype, num_local,
                   batch_invariant, rhs_transposed):
    return jax.core.ShapedArray(_result_shape(kind, a, b, num_local, rhs_transposed), out_dtype,
                                **_ffi.varying_type((a, b, group_sizes, group_offset)))


def _bind(kind, a, b, group_sizes, group_offset, out_dtype, num_local, batch_invariant,
          rhs_transposed=False):
    """One kernel. Inside shard_map its operands are first made to vary over every axis any of
    them varies over: the kernel's operands then agree, and the transposes of those casts (psums)
    sum a replicated operand's cotangent over the axes."""
    args = _ffi.vary_alike((a, b, group_sizes, group_offset))
    return _PRIMITIVES[kind].bind(*args, out_dtype=np.dtype(out_dtype), num_local=num_local,
                                  batch_invariant=bool(batch_invariant),
                                  rhs_transposed=bool(rhs_transposed))


def _jvp(kind, primals, tangents, *, out_dtype, num_local, batch_invariant, rhs_transposed):
    a, b, group_sizes, group_offset = primals
    da, db = tangents[:2]
    out = _bind(kind, a, b, group_sizes, group_offset, out_dtype, num_local, batch_invariant,
                rhs_transposed)
    terms = [_bind(kind, x, y, group_sizes, group_offset, out_dtype, num_local, batch_invariant,
                   rhs_transposed)
             for x, y, t in ((da, b, da), (a, db, db)) if type(t) is not ad.Zero]
    if not terms:
        return out, ad.Zero.from_primal_value(out)
    return out, terms[0] if len(terms) == 1 else terms[0] + terms[1]


def _transpose(kind, ct, a, b, group_sizes, group_offset, *, out_dtype, num_local,
               batch_invariant, rhs_transposed):
    first = ad.is_undefined_primal(a)
    known, unknown = (b, a) if first else (a, b)
    if type(ct) is ad.Zero:
        grad = ad.Zero(unknown.aval)
    else:
        other, order = _TRANSPOSES[kind][0 if first else 1]
        # The kernels take the cotangent in the operands' dtype.
        x, y = order(ct.astype(known.dtype), known)
        grad = _bind(other, x, y, group_sizes, group_offset, unknown.aval.dtype, num_local,
                     batch_invariant, rhs_transposed)
    return (grad, None, None, None) if first else (None, grad, None, None)


def _map_batch(call, args, dims):
    """Under vmap: `call` once per batch element (a lax.map over the batch)."""
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    moved = tuple(jnp.moveaxis(x, d, 0) if d is not None else
                  jnp.broadcast_to(x, (size,) + x.shape) for x, d in zip(args, dims))
    return jax.lax.map(lambda xs: call(*xs), moved), 0


def _batch(kind, args, dims, *, out_dtype, num_local, batch_invariant, rhs_transposed):
    return _map_batch(lambda *xs: _bind(kind, *xs, out_dtype, num_local, batch_invariant,
                                        rhs_transposed), args, dims)


def _lower(kind, ctx, *args, out_dtype, num_local, batch_invariant, rhs_transposed):
    """The kernel's call, split over the mesh by its partitioning rule under a sharded `jit`."""
    fn = _ragged_dot_sharding.partitioned(_impl, kind, np.dtype(out_dtype), num_local,
                                          batch_invariant, rhs_transposed)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)


def _primitive(kind):
    p = Primitive(f"moekit_ragged_dot_{kind}")
    impl = functools.partial(_impl, kind)
    p.def_impl(impl)
    p.def_abstract_eval(functools.partial(_abstract_eval, kind))
    mlir.register_lowering(p, functools.partial(_lower, kind))
    # custom_partitioning needs the devices when the call is lowered; JAX's own partitioned
    # primitives (cuDNN attention) declare it in this set, which has no public name.
    dispatch.prim_requires_devices_during_lowering.add(p)
    ad.primitive_jvps[p] = functools.partial(_jvp, kind)
    ad.primitive_transposes[p] = functools.partial(_transpose, kind)
    batching.primitive_batchers[p] = functools.partial(_batch, kind)
    return p


_PRIMITIVES = {kind: _primitive(kind) for kind in _TARGETS}


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
               group_offset=None, *, batch_invariant=False):
    """Grouped matrix multiply, `jax.lax.ragged_dot` with a working `group_offset`.

    Rows of `lhs` are grouped by `group_sizes`: group j holds rows
    ``start[j] .. start[j] + group_sizes[j]`` with ``start[j] = sum(group_sizes[:j])``. The
    groups ``group_offset .. group_offset + E_loc - 1`` are local, and local group j multiplies
    by ``rhs[j - group_offset]``. Every other row of the result (non-local groups, and rows at
    or past ``sum(group_sizes)``) is exactly 0 and is never computed, so a shard holding a
    quarter of the experts does a quarter of the work.

    Runs on the CPU, and on NVIDIA GPUs where moekit was built with CUDA (`cuda_built()`): there
    `group_sizes` and `group_offset` stay on the device, and a call never waits for the host.
    Bad values known only when the program runs differ by platform: on the CPU a negative size,
    sizes past m or an out-of-range traced offset raise; on a GPU they are clamped (a negative
    size counts as 0, rows past m drop out, the offset is held in [0, G - E_loc]).

    The signature and dtype rules are `jax.lax.ragged_dot`'s (`group_offset` last, by keyword):
    inputs of different float dtypes are promoted to a common one, and the result may be any
    float dtype. The kernels take float32 and bfloat16 (and float16 on a GPU) and accumulate in
    float32; other results are computed so and rounded once.

    Args:
      lhs: ``[m, K]`` float32, bfloat16 or float16 (on the CPU float16 is computed in float32).
      rhs: ``[E_loc, K, n]``: the local groups' matrices; promoted with `lhs`. Or a
        `PackedRhs` (`pack_ragged_rhs`) for the CPU: then lhs has its dtype (bfloat16 or
        float32), and only lhs has a gradient, where the transposes are packed too
        (``input_gradient=True``).
      group_sizes: ``[G]`` integers, ``G >= E_loc``, each >= 0, summing to at most m.
      precision: accepted as `jax.lax.ragged_dot` does; products always accumulate in float32.
      preferred_element_type: the result dtype, any float dtype (default: the promoted inputs').
      group_offset: the first local group, an integer scalar or shape-(1,) array in
        ``[0, G - E_loc]``; may be traced (e.g. ``axis_index * E_loc`` in `shard_map`). None:
        0, and then G must equal E_loc, as in `jax.lax.ragged_dot`.
      batch_invariant: each result row the same bits whatever the other rows (its group's
        size, the other groups, m, the offset) and the threads, in the call and in its
        gradients (the weight gradient sums a group's rows in one order fixed by their
        positions: the same rows give the same bits). CPU only; see the C++
        `RaggedDotOptions::batch_invariant`, and bench/results/invariant-* for its cost.

    Returns:
      ``[m, n]`` in `preferred_element_type`.

    Derivatives of any order and mode (`grad`, `jvp`, `hessian`, `linear_transpose`) flow to
    `lhs` and `rhs` in their own dtypes, each computed by the C++ kernels (the cotangent rounded
    to the inputs' dtype first). Under `vmap`, each batch element is one call. Under `jit`
    with shardings, rhs sharded over n and lhs sharded over rows (or both over K) stay sharded:
    each device runs its part (see `_ragged_dot_sharding`).
    """
    if isinstance(rhs, PackedRhs):
        return _ragged_packed(lhs, rhs, group_sizes, precision, preferred_element_type,
                              group_offset, batch_invariant)
    return _ragged_rows("ragged_dot", lhs, rhs, group_sizes, precision, preferred_element_type,
                        group_offset, batch_invariant, rhs_transposed=False)


@jax.tree_util.register_pytree_node_class
class PackedRhs:
    """Expert weights ``[E_loc, K, n]`` in the layout of the CPU's inference forward, as
    `pack_ragged_rhs` makes them, each panel of 32 output columns holding its whole contraction
    front to back, the padding 0: `data` in bfloat16 ``[E_loc, ceil(n / 32), 64 * ceil(K / 2)]``,
    the contraction as pairs (element ``(j, k, c)`` at ``data[j, c // 32, 64 * (k // 2) + 2 *
    (c % 32) + k % 2]``), or in float32 ``[E_loc, ceil(n / 32), 32 * K]`` (at ``data[j, c //
    32, 32 * k + c % 32]``). `data_t`, where it is packed too (`pack_ragged_rhs(...,
    input_gradient=True)`), holds the transposes ``[E_loc, n, K]`` in the same layout, which
    lhs's gradient reads. `ragged_dot` takes it in place of rhs. A pytree (its leaves `data` and
    `data_t`; K and n static), so it passes through `jit`, `device_put` and checkpoints as an
    array does."""

    ndim = 3

    def __init__(self, data, k, n, data_t=None):
        self.data, self.k, self.n, self.data_t = data, int(k), int(n), data_t

    @property
    def num_local(self):
        return self.data.shape[0]

    @property
    def dtype(self):
        """The weights' dtype, `data`'s: bfloat16 or float32."""
        return np.dtype(self.data.dtype)

    @property
    def shape(self):
        """The weights' shape before packing, ``(E_loc, K, n)`` (`data` holds them packed)."""
        return (self.num_local, self.k, self.n)

    def tree_flatten(self):
        return (self.data, self.data_t), (self.k, self.n)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux, data_t=children[1])

    def __repr__(self):
        grad = ", input_gradient" if self.data_t is not None else ""
        return f"PackedRhs(E_loc={self.num_local}, K={self.k}, n={self.n}{grad})"


def pack_ragged_rhs(rhs, *, rhs_transposed=False, input_gradient=False):
    """Expert weights in the packed layout of `PackedRhs`, for the CPU, where the weights do not
    change (inference, or frozen experts) and every forward call reads them. The C++
    `pack_ragged_rhs` makes the same layout. The forward on it ran 0.98-1.55x as fast as on the
    same weights unpacked at 1-2048 tokens (bench/results/ragged_dot_small-cpu-2026-11-29-5, a
    Zen 4 EPYC). The packed weights take no gradient, and CUDA does not read them; lhs's
    gradient needs their transposes packed too (`input_gradient`).

    Args:
      rhs: ``[E_loc, K, n]`` bfloat16 or float32 (``[E_loc, n, K]``, a linear layer's
        ``[out, in]`` per expert, with `rhs_transposed`).
      rhs_transposed: rhs is ``[E_loc, n, K]``.
      input_gradient: also pack the transposes (`PackedRhs.data_t`, as many bytes again), so
        that `ragged_dot` on them differentiates to lhs (the C++ input gradient on packed
        weights).

    Returns:
      a `PackedRhs` of rhs's dtype: ``[E_loc, ceil(n / 32), 64 * ceil(K / 2)]`` in bfloat16,
      ``[E_loc, ceil(n / 32), 32 * K]`` in float32.
    """
    fn = "pack_ragged_rhs"
    rhs = jnp.asarray(rhs)
    _ffi.check_rank(fn, "rhs", rhs, 3, "[E_loc, n, K]" if rhs_transposed else "[E_loc, K, n]")
    if rhs.dtype not in (jnp.bfloat16, jnp.float32):
        raise TypeError(f"{fn}: rhs dtype {rhs.dtype} is neither bfloat16 nor float32 (the "
                        f"packed layout holds those; cast the weights first)")
    w = jnp.swapaxes(rhs, 1, 2) if _ffi.bool_arg(fn, "rhs_transposed", rhs_transposed) else rhs
    data_t = (_packed_layout(jnp.swapaxes(w, 1, 2))
              if _ffi.bool_arg(fn, "input_gradient", input_gradient) else None)
    return PackedRhs(_packed_layout(w), w.shape[1], w.shape[2], data_t)


def _packed_shape(e, k, n, dtype):
    """The packed layout's shape for [e, k, n] weights, and the contraction rows per 32-bit
    word (a bfloat16 pair, or one float32)."""
    per = 2 if dtype == jnp.bfloat16 else 1
    return (e, -(-n // 32), 32 * per * -(-k // per)), per


def _packed_layout(w):
    """[E, K, n] weights in PackedRhs's layout."""
    e, k, n = w.shape
    shape, per = _packed_shape(e, k, n, w.dtype)
    words, panels = shape[2] // (32 * per), shape[1]
    w = jnp.pad(w, ((0, 0), (0, per * words - k), (0, 32 * panels - n)))
    # [E, word, k % per, panel, c % 32] -> [E, panel, word, c % 32, k % per]
    w = w.reshape(e, words, per, panels, 32).transpose(0, 3, 1, 4, 2)
    return w.reshape(shape)


def _ragged_packed(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset,
                   batch_invariant):
    """ragged_dot's forward on a PackedRhs: rows of its dtype on the CPU; lhs's gradient where
    the transposes are packed too, none otherwise."""
    fn = "ragged_dot"
    _check_precision(precision)
    lhs = jnp.asarray(lhs)
    _ffi.check_rank(fn, "lhs", lhs, 2, "[m, K]")
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"{fn}: lhs dtype {lhs.dtype} is not the packed weights' "
                        f"(PackedRhs) {rhs.dtype}, which they need")
    if lhs.shape[1] != rhs.k:
        raise ValueError(f"{fn}: lhs.shape[1] = {lhs.shape[1]} differs from the packed weights' "
                         f"K = {rhs.k} (the contraction size)")
    _, kernel_out, out_dtype = _dtypes(fn, lhs, lhs, preferred_element_type)
    group_sizes, group_offset = _groups(fn, jnp.asarray(group_sizes), group_offset,
                                        rhs.num_local)
    invariant = _ffi.bool_arg(fn, "batch_invariant", batch_invariant)
    # The packed arrays' shapes, checked here: a PackedRhs built by hand that disagrees would
    # otherwise meet the kernel's error only in the backward, under another name.
    for name, arr, k, n in (("data", rhs.data, rhs.k, rhs.n), ("data_t", rhs.data_t, rhs.n, rhs.k)):
        want = _packed_shape(rhs.num_local, k, n, rhs.dtype)[0]
        if arr is not None and (tuple(arr.shape) != want or arr.dtype != rhs.dtype):
            raise ValueError(f"{fn}: PackedRhs.{name} is {tuple(arr.shape)} {arr.dtype}; K = "
                             f"{rhs.k}, n = {rhs.n} pack into {want} {rhs.dtype} "
                             f"(pack_ragged_rhs)")
    has_t = rhs.data_t is not None
    data_t = rhs.data_t if has_t else jnp.zeros((0,), rhs.dtype)
    return _PACKED.bind(*_ffi.vary_alike((lhs, rhs.data, data_t, group_sizes, group_offset)),
                        out_dtype=np.dtype(kernel_out), n_out=rhs.n, has_t=has_t,
                        batch_invariant=invariant).astype(out_dtype)


# The forward on packed weights, as a primitive linear in its first operand: packed(a, P, Pt) =
# a @ W per group, with P = W packed and Pt = W^T packed (or, where has_t is false, an empty
# placeholder). Its JVP is itself and its transpose packed(ct, Pt, P) (ragged_dot_dlhs on Pt):
# jvp reaches a always, grad and linear_transpose where Pt is there; the packed weights take
# no derivative (an error names them).
def _packed_impl(a, data, data_t, group_sizes, group_offset, *, out_dtype, n_out, has_t,
                 batch_invariant):
    return _ffi.call("moekit_ragged_dot_fwd_packed", ((a.shape[0], n_out), out_dtype), a, data,
                     group_sizes, group_offset, batch_invariant=batch_invariant)


def _packed_abstract_eval(a, data, data_t, group_sizes, group_offset, *, out_dtype, n_out,
                          has_t, batch_invariant):
    return jax.core.ShapedArray((a.shape[0], n_out), out_dtype,
                                **_ffi.varying_type((a, data, data_t, group_sizes,
                                                     group_offset)))


def _packed_no_weight_gradient():
    return TypeError("ragged_dot: packed weights (PackedRhs) take no gradient; differentiate "
                     "with the weights unpacked")


def _packed_jvp(primals, tangents, **params):
    if any(type(t) is not ad.Zero for t in tangents[1:3]):
        raise _packed_no_weight_gradient()
    out = _PACKED.bind(*primals, **params)
    if type(tangents[0]) is ad.Zero:
        return out, ad.Zero.from_primal_value(out)
    return out, _PACKED.bind(tangents[0], *primals[1:], **params)


def _packed_transpose(ct, a, data, data_t, group_sizes, group_offset, *, out_dtype, n_out,
                      has_t, batch_invariant):
    if ad.is_undefined_primal(data) or ad.is_undefined_primal(data_t):
        raise _packed_no_weight_gradient()
    if not has_t:
        raise TypeError("ragged_dot: packed weights (PackedRhs) serve the forward only, for "
                        "inference; for lhs's gradient pack them with input_gradient=True, for "
                        "theirs differentiate with the weights unpacked")
    if type(ct) is ad.Zero:
        return (ad.Zero(a.aval), None, None, None, None)
    # The kernel takes the cotangent in the operands' dtype.
    grad = _PACKED.bind(ct.astype(data.dtype), data_t, data, group_sizes, group_offset,
                        out_dtype=np.dtype(a.aval.dtype), n_out=a.aval.shape[1], has_t=True,
                        batch_invariant=batch_invariant)
    return (grad, None, None, None, None)


def _packed_batch(args, dims, **params):
    return _map_batch(lambda *xs: _PACKED.bind(*xs, **params), args, dims)


_PACKED = Primitive("moekit_ragged_dot_packed")
_PACKED.def_impl(_packed_impl)
_PACKED.def_abstract_eval(_packed_abstract_eval)
mlir.register_lowering(_PACKED, lambda ctx, *args, **params: mlir.lower_fun(
    functools.partial(_packed_impl, **params), multiple_results=False)(ctx, *args))
ad.primitive_jvps[_PACKED] = _packed_jvp
ad.primitive_transposes[_PACKED] = _packed_transpose
batching.primitive_batchers[_PACKED] = _packed_batch


def _ragged_rows(fn, lhs, rhs, group_sizes, precision, preferred_element_type, group_offset,
                 batch_invariant, rhs_transposed):
    """ragged_dot's forward (`fn` names the caller in the errors), rhs ``[E_loc, n, K]`` where
    `rhs_transposed`: the kernels read that layout as it lies."""
    _check_precision(precision)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    group_sizes = jnp.asarray(group_sizes)
    _ffi.check_rank(fn, "lhs", lhs, 2, "[m, K]")
    _ffi.check_rank(fn, "rhs", rhs, 3, "[E_loc, n, K]" if rhs_transposed else "[E_loc, K, n]")
    common, kernel_out, out_dtype = _dtypes(fn, lhs, rhs, preferred_element_type)
    k_dim = 2 if rhs_transposed else 1
    if rhs.shape[k_dim] != lhs.shape[1]:
        raise ValueError(f"{fn}: rhs.shape[{k_dim}] = {rhs.shape[k_dim]} differs from "
                         f"lhs.shape[1] = {lhs.shape[1]} (the contraction size K)")
    group_sizes, group_offset = _groups(fn, group_sizes, group_offset, rhs.shape[0])
    out = _bind("fwd", lhs.astype(common), rhs.astype(common), group_sizes, group_offset,
                kernel_out, rhs.shape[0], _ffi.bool_arg(fn, "batch_invariant", batch_invariant),
                rhs_transposed)
    return out.astype(out_dtype)


def _groups(fn, group_sizes, group_offset, num_local):
    """group_sizes as int32 [G] and group_offset as int32 [1] (0 where None, and then G must be
    num_local), checked against the num_local groups the weights hold."""
    _ffi.check_int_vector(fn, "group_sizes", group_sizes)
    num_groups = group_sizes.shape[0]
    if group_offset is None:
        if num_groups != num_local:
            raise ValueError(f"{fn}: group_sizes has {num_groups} groups but rhs holds "
                             f"{num_local}; pass group_offset to compute a subset of the groups")
        group_offset = jnp.zeros((1,), jnp.int32)
    else:
        group_offset = jnp.asarray(group_offset)
        if group_offset.shape not in ((), (1,)) or not jnp.issubdtype(group_offset.dtype,
                                                                       jnp.integer):
            raise ValueError(f"{fn}: group_offset must be an integer scalar or shape (1,), "
                             f"got {group_offset.dtype}{list(group_offset.shape)}")
        if num_groups < num_local:
            raise ValueError(f"{fn}: group_sizes has {num_groups} groups, fewer than the "
                             f"{num_local} that rhs holds")
        value = _ffi.concrete_int(group_offset)
        if value is not None and not 0 <= value <= num_groups - num_local:
            raise ValueError(f"{fn}: group_offset = {value} is outside "
                             f"[0, {num_groups - num_local}] (G = {num_groups}, "
                             f"E_loc = {num_local})")
        group_offset = _ffi.as_int32(fn, "group_offset", group_offset).reshape((1,))
    return _ffi.as_int32(fn, "group_sizes", group_sizes), group_offset


def _dtypes(fn, lhs, rhs, preferred_element_type):
    """(the dtype the kernels take, the dtype they write, the result's) under JAX's rules:
    mixed inputs computed in f32 (both convert exactly); the result, as dot_general's, the input
    dtype of the wider exponent, then of the longer mantissa (f32, then bf16, then f16), or any
    float preferred_element_type; the kernels write f32 or their input dtype, and any other
    result is f32 rounded once."""
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if x.dtype not in _DTYPES:
            raise TypeError(f"{fn}: {name} dtype {x.dtype} is not float32, bfloat16 or float16")
    common = lhs.dtype if lhs.dtype == rhs.dtype else np.dtype(jnp.float32)
    wider = max(lhs.dtype, rhs.dtype, key=lambda d: (jnp.finfo(d).maxexp, jnp.finfo(d).nmant))
    out_dtype = wider if preferred_element_type is None else np.dtype(preferred_element_type)
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(f"{fn}: preferred_element_type {out_dtype} is not a float dtype")
    kernel_out = out_dtype if out_dtype in (np.dtype(jnp.float32), common) else jnp.float32
    return common, np.dtype(kernel_out), out_dtype


def ragged_dot_general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision=None,
                       preferred_element_type=None, group_offset=None, *,
                       batch_invariant=False):
    """`jax.lax.ragged_dot_general` for the two forms MoE layers use, on moekit's kernels.

    - Ragged rows (the forward): lhs ``[m, K]`` (or ``[K, m]``) with its non-contracting
      dimension ragged, rhs of rank 3 with one group, one contracting and one output dimension
      in any order; the result ``[m, n]``, as `ragged_dot` gives it (`group_offset` too). An rhs
      ``[G, K, n]`` or ``[G, n, K]`` (each expert's matrix stored as a linear layer's weight,
      ``[out, in]``) is read as it lies, forward and backward, its gradient in the same layout;
      other orders are transposed to ``[G, K, n]`` first (a copy). On the CPU each pass streams
      the weights fastest along its contraction: qwen3-30b-a3b's forward ran 1.1-1.6x faster on
      ``[G, n, K]`` at 128-4096 tokens (8-256 rows a group), its input gradient 1.2-1.5x
      faster on ``[G, K, n]`` at 512-2048 (bench/results/ragged_dot_small-cpu-2026-11-28-5).
    - Ragged contraction (the weight gradient): lhs ``[m, K]`` and rhs ``[m, n]`` (or
      transposed) contracting their ragged dimension m; the result ``[G, K, n]``, group j's
      ``lhs[rows of j]^T @ rhs[rows of j]`` (0 for an empty group). No group_offset here.

    Batch dimensions and other forms raise NotImplementedError naming what is supported. Dtypes,
    precision, gradients and `batch_invariant` as in `ragged_dot`.
    """
    fn = "ragged_dot_general"
    _check_precision(precision)
    if isinstance(rhs, PackedRhs):
        raise TypeError(f"{fn}: packed weights (PackedRhs) go to ragged_dot, whose layout they "
                        f"fix")
    lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
    dn = ragged_dot_dimension_numbers
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dn.dot_dimension_numbers
    ragged, groups = list(dn.lhs_ragged_dimensions), list(dn.rhs_group_dimensions)
    if (lhs_batch or rhs_batch or lhs.ndim != 2 or len(lhs_contract) != 1
            or len(rhs_contract) != 1 or len(ragged) != 1):
        raise NotImplementedError(
            f"{fn}: supported are a rank-2 lhs with one contracting and one ragged dimension and "
            f"no batch dimensions; got lhs {tuple(lhs.shape)}, rhs {tuple(rhs.shape)}, {dn}")
    if ragged[0] != lhs_contract[0]:  # ragged rows
        if rhs.ndim != 3 or len(groups) != 1:
            raise NotImplementedError(f"{fn}: ragged rows need a rank-3 rhs with one group "
                                      f"dimension; got rhs {tuple(rhs.shape)}, {dn}")
        out_dim = ({0, 1, 2} - {groups[0], rhs_contract[0]}).pop()
        rows = lhs if lhs_contract[0] == 1 else lhs.T  # [m, K]
        transposed = (groups[0], rhs_contract[0], out_dim) == (0, 2, 1)  # [G, n, K] as it lies
        weights = rhs if transposed else jnp.transpose(rhs, (groups[0], rhs_contract[0], out_dim))
        return _ragged_rows(fn, rows, weights, group_sizes, precision, preferred_element_type,
                            group_offset, batch_invariant, rhs_transposed=transposed)
    if rhs.ndim != 2 or groups:
        raise NotImplementedError(f"{fn}: a ragged contraction needs a rank-2 rhs and no group "
                                  f"dimension; got rhs {tuple(rhs.shape)}, {dn}")
    if group_offset is not None:
        raise NotImplementedError(f"{fn}: group_offset with a ragged contraction")
    a = lhs if lhs_contract[0] == 0 else lhs.T  # [m, K]
    b = rhs if rhs_contract[0] == 0 else rhs.T  # [m, n]
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"{fn}: the contracted sizes differ: {a.shape[0]} (lhs) and "
                         f"{b.shape[0]} (rhs)")
    _ffi.check_int_vector(fn, "group_sizes", group_sizes)
    common, kernel_out, out_dtype = _dtypes(fn, a, b, preferred_element_type)
    group_sizes = _ffi.as_int32(fn, "group_sizes", group_sizes)
    out = _bind("drhs", a.astype(common), b.astype(common), group_sizes,
                jnp.zeros((1,), jnp.int32), kernel_out, group_sizes.shape[0],
                _ffi.bool_arg(fn, "batch_invariant", batch_invariant))
    return out.astype(out_dtype)


def _check_precision(precision):
    """Anything jax.lax.ragged_dot takes as precision passes (and is not needed: products always
    accumulate in f32); a number or an array is a group_offset in moekit's old fourth place."""
    if isinstance(precision, (int, np.integer)) or hasattr(precision, "shape"):
        raise TypeError(f"ragged_dot: precision = {precision!r} is a number, not a precision (the "
                        f"fourth argument is precision, as in jax.lax.ragged_dot; pass "
                        f"group_offset= by keyword)")
