"""The FFI plumbing shared by moekit.jax's modules: loading libmoekit_jax.so (ctypes), the jaxlib
version check, the handlers' registration for the CPU and CUDA platforms, and one helper per
kind of call."""

from __future__ import annotations

import ctypes
import functools
import math
import operator
import os
import pathlib
import sys
import warnings
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

LIBRARY = pathlib.Path(__file__).resolve().parent.parent / "libmoekit_jax.so"


class _Target(ctypes.Structure):
    """moekit::python::Target (python/csrc/ffi_common.h)."""
    _fields_ = [("name", ctypes.c_char_p), ("platform", ctypes.c_char_p),
                ("handler", ctypes.c_void_p)]


# moekit::python::LayerAttrs (python/csrc/ffi_layer.h), field by field: the whole layer's
# handlers take it as one attribute, moekit_ffi_layer_workspace as this struct.
LAYER_FIELDS = (("hidden", ctypes.c_int64, np.int64), ("ffn", ctypes.c_int64, np.int64),
                ("num_experts", ctypes.c_int64, np.int64),
                ("shared_ffn", ctypes.c_int64, np.int64), ("k", ctypes.c_int32, np.int32),
                ("score", ctypes.c_int32, np.int32), ("pre_softmax", ctypes.c_bool, np.bool_),
                ("num_groups", ctypes.c_int32, np.int32),
                ("group_topk", ctypes.c_int32, np.int32),
                ("scaling_factor", ctypes.c_float, np.float32),
                ("activation", ctypes.c_int32, np.int32),
                ("capacity_factor", ctypes.c_double, np.float64),
                ("drop_policy", ctypes.c_int32, np.int32),
                ("align_size", ctypes.c_int64, np.int64),
                ("aux_loss_coeff", ctypes.c_float, np.float32),
                ("aux_loss_sequences", ctypes.c_int32, np.int32),
                ("z_loss_coeff", ctypes.c_float, np.float32),
                ("batch_invariant", ctypes.c_bool, np.bool_),
                ("expert_weights_transposed", ctypes.c_bool, np.bool_),
                ("expert_weights_packed", ctypes.c_bool, np.bool_))


class _LayerAttrs(ctypes.Structure):
    _fields_ = [(name, ctype) for name, ctype, _ in LAYER_FIELDS]


def _load(path):
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise ImportError(f"moekit.jax: cannot load its XLA FFI handlers {path}: {e}; build and "
                          f"install the package with `pip install --no-build-isolation .`") from e
    lib.moekit_ffi_built_with_jaxlib.restype = ctypes.c_char_p
    lib.moekit_ffi_cuda_built.restype = ctypes.c_bool
    lib.moekit_ffi_cuda_workspace_bytes.restype = ctypes.c_int64
    lib.moekit_ffi_cuda_workspace_bytes.argtypes = [ctypes.c_int64]
    lib.moekit_ffi_cuda_router_workspace_bytes.restype = ctypes.c_int64
    lib.moekit_ffi_cuda_router_workspace_bytes.argtypes = [ctypes.c_int64] * 2
    lib.moekit_ffi_cuda_permute_workspace_bytes.restype = ctypes.c_int64
    lib.moekit_ffi_cuda_permute_workspace_bytes.argtypes = [ctypes.c_int64] * 4
    lib.moekit_ffi_layer_workspace.restype = ctypes.c_bool
    lib.moekit_ffi_layer_workspace.argtypes = [ctypes.POINTER(_LayerAttrs), ctypes.c_int64,
                                               ctypes.c_bool, ctypes.POINTER(ctypes.c_int64)]
    lib.moekit_ffi_permute_max_rows.restype = ctypes.c_int64
    lib.moekit_ffi_permute_max_rows.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int32,
                                                ctypes.c_int64, ctypes.c_double, ctypes.c_bool]
    return lib


def _version(v):
    return tuple(int(x) for x in v.split(".")[:3] if x.isdigit())


def keep_large_blocks_in_the_heap():
    """XLA:CPU allocates every result anew, and glibc serves large blocks with fresh mmaps whose
    pages fault in on first touch: at qwen3 shapes a third of a ragged_dot forward + backward
    (bench/results/jax_ragged_dot-cpu-2026-11-24), 300 MB of faults per moe_layer forward and
    1.7 GB per forward + backward (bench/results/jax_layer-cpu-2026-11-25). Three settings keep
    them in the heap for reuse, as the MALLOC_*_ environment variables would: the mmap threshold
    raised to its maximum; one arena (M_ARENA_MAX = 1: XLA allocates on its worker threads, and
    a thread's own arena is at most 64 MiB, so a larger block there is mmapped whatever the
    threshold); and no trimming, so that the freed top of the heap is not handed back to be
    faulted in again. Done once, at import, with glibc only, and not where the
    program set any of them itself (MALLOC_MMAP_THRESHOLD_, MALLOC_ARENA_MAX,
    MALLOC_TRIM_THRESHOLD_), or with MOEKIT_KEEP_MALLOC=0. Threads that allocated before the
    import keep their arenas: import moekit.jax before the first JAX computation. The costs:
    freed blocks stay in the process instead of going back to the system, and threads share one
    arena's lock. Returns whether the settings were made."""
    variables = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_")
    if (not sys.platform.startswith("linux") or any(v in os.environ for v in variables)
            or os.environ.get("MOEKIT_KEEP_MALLOC") == "0"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    return all(bool(mallopt(option, ctypes.c_int(value))) for option, value in (
        (m_mmap_threshold, 2**31 - 1),
        # -1: never trim (mallopt(3)). The largest positive value, 2 GiB, is less than the top
        # of the heap a moe_layer forward + backward frees at qwen3 shapes: the heap shrank by
        # up to 2.4 GB on some calls, and the next call faulted it in again (strace, 2026-11-25).
        (m_trim_threshold, -1),
        (m_arena_max, 1)))


def _backend_started():
    """Whether JAX has started a backend (and with it XLA's worker threads) already."""
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # a JAX without it: nothing to say
        return False


_STARTED_BEFORE = _backend_started()
KEPT_LARGE_BLOCKS = keep_large_blocks_in_the_heap()
if KEPT_LARGE_BLOCKS and _STARTED_BEFORE and jax.default_backend() == "cpu":
    warnings.warn(
        "moekit.jax was imported after JAX started its backend: XLA's worker threads keep the "
        "malloc arenas they have, which map every block over 64 MiB afresh, so that its pages "
        "fault in again on every call (2 GB per moe_layer forward + backward at qwen3-30b-a3b's "
        "shapes, bench/results/jax_layer-cpu-2026-11-25-3). Import moekit.jax before the first "
        "JAX computation.", stacklevel=2)
_lib = _load(LIBRARY)
BUILT_WITH_JAXLIB = _lib.moekit_ffi_built_with_jaxlib().decode()
if _version(jax.lib.__version__) < _version(BUILT_WITH_JAXLIB):
    raise ImportError(
        f"moekit was built against the XLA FFI headers of jaxlib {BUILT_WITH_JAXLIB}, "
        f"newer than the jaxlib {jax.lib.__version__} running now; reinstall moekit "
        f"(pip install --no-build-isolation .) with this jaxlib installed")


def targets(table_fn=None):
    """[(name, platform, handler address)] of every handler in a library's table: its
    moekit_ffi_*targets function (default: libmoekit_jax.so's, the CPU handlers and, in a build
    with CUDA, the CUDA ones)."""
    table_fn = table_fn or _lib.moekit_ffi_targets
    table_fn.restype = ctypes.c_int64
    table_fn.argtypes = [ctypes.POINTER(ctypes.POINTER(_Target))]
    table = ctypes.POINTER(_Target)()
    count = table_fn(ctypes.byref(table))
    return [(table[i].name.decode(), table[i].platform.decode(), table[i].handler)
            for i in range(count)]


def register(table_fn=None):
    """Registers with XLA every handler of a library's table (see `targets`)."""
    for name, platform, handler in targets(table_fn):
        # Registering for CUDA where jaxlib has no CUDA backend is harmless: jaxlib keeps it for
        # a backend that never comes.
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform=platform)


register()


def cuda_built():
    """Whether this build of moekit has the CUDA handlers (every op of the layer on JAX's GPU
    platform)."""
    return bool(_lib.moekit_ffi_cuda_built())


@functools.lru_cache(maxsize=None)
def cuda_workspace_bytes(num_local):
    """Bytes of the workspace result of a CUDA ragged_dot call with `num_local` local groups,
    for the current CUDA device (its kernels' needs depend on the architecture and the number of
    multiprocessors): computed when a function is traced, so a program must run on GPUs like
    the one it was traced beside. A smaller workspace is refused by the call, with both sizes."""
    return int(_lib.moekit_ffi_cuda_workspace_bytes(num_local))


def _checked_bytes(fn, bytes_, sizes):
    if bytes_ < 0:
        raise ValueError(f"{fn}: sizes {sizes}: past what the CUDA kernels accept")
    return bytes_


@functools.lru_cache(maxsize=None)
def cuda_router_workspace_bytes(T, E):
    """Bytes of the workspace result of a CUDA router loss call on T tokens of E experts."""
    return _checked_bytes("router", int(_lib.moekit_ffi_cuda_router_workspace_bytes(T, E)),
                          (T, E))


@functools.lru_cache(maxsize=None)
def cuda_permute_workspace_bytes(T, S, E, N):
    """Bytes of the workspace result of a CUDA permutation call: T tokens, S slots per token, E
    experts (C chunks for sort_chunks_by_index), N rows of the permuted buffer."""
    return _checked_bytes("permute",
                          int(_lib.moekit_ffi_cuda_permute_workspace_bytes(T, S, E, N)),
                          (T, S, E, N))


def permute_max_rows(T, E, k, align_size, capacity_factor, pad_to_capacity):
    """The rows permute needs at most for any routing: the static N_out of its outputs."""
    return int(_lib.moekit_ffi_permute_max_rows(T, E, k, align_size, capacity_factor,
                                                pad_to_capacity))


def layer_attrs(**values):
    """The whole layer's attributes from every LayerAttrs field by name: a hashable tuple of
    (name, numpy scalar) pairs, in the struct's order."""
    if set(values) != {name for name, _, _ in LAYER_FIELDS}:
        raise TypeError(f"layer_attrs: fields {sorted(values)} are not LayerAttrs' "
                        f"{[name for name, _, _ in LAYER_FIELDS]}")
    return tuple((name, np_type(values[name])) for name, _, np_type in LAYER_FIELDS)


@functools.lru_cache(maxsize=None)
def layer_workspace(attrs, T, bf16):
    """Bytes of the whole layer calls' byte results for T tokens: (the forward's saved
    activations, the residual; the forward's scratch; the backward's scratch), or None for a
    config the layer refuses."""
    struct = _LayerAttrs(**{name: value.item() for name, value in attrs})
    sizes = (ctypes.c_int64 * 3)()
    if not _lib.moekit_ffi_layer_workspace(ctypes.byref(struct), T, bf16, sizes):
        return None
    return tuple(sizes)


FLOAT_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))


class Cuda(NamedTuple):
    """How a handler's call differs on CUDA from the CPU's, for `call`'s cuda argument.

    workspace: bytes of the workspace result the CUDA handler takes after its own results
      (allocated by XLA beside them, so that the call allocates nothing and can be replayed in a
      CUDA graph; dropped from what `call` returns); 0: none.
    args: which of the call's arguments the CUDA handler takes (indices; None: all of them).
    attrs: attributes added on CUDA (e.g. a cotangent the CPU handler reads from a buffer).
    results: the CUDA handler's (shape, dtype) results, where they differ from the CPU's.
    finish: f(results, args) -> the call's results, applied to the CUDA handler's (e.g. scaling
      by a cotangent that the handler took as 1).
    """
    workspace: int = 0
    args: Optional[tuple] = None
    attrs: Optional[dict] = None
    results: Any = None
    finish: Optional[Callable] = None


def call(name, results, *args, has_side_effect=False, aliases=None, cuda=None, **attrs):
    """One FFI call. `results` is one (shape, dtype) pair or a list of them (then a list comes
    back); attrs become the handler's attributes. Under vmap the batch runs as a loop of calls;
    inside shard_map the results vary over the axes the operands vary over. has_side_effect: XLA
    must neither drop the call nor merge it with an equal one (a collective). aliases: {argument
    index: result index}, a result written in its argument's buffer (XLA copies the argument
    first where it is still needed).

    cuda: None for a handler of the CPU only; a `Cuda` for one that CUDA has too, under the same
    name. Then, in a build with CUDA, the call is `jax.lax.platform_dependent` on the CPU and
    CUDA handlers: only the branch of the platform compiled for is lowered."""
    def on(platform_results, platform_args, platform_attrs):
        single = isinstance(platform_results, tuple)
        typed = _varying_type(platform_args)
        structs = [jax.ShapeDtypeStruct(s, d, **typed)
                   for s, d in ([platform_results] if single else platform_results)]
        out = jax.ffi.ffi_call(name, structs, vmap_method="sequential",
                               has_side_effect=has_side_effect,
                               input_output_aliases=aliases)(*platform_args, **platform_attrs)
        return out[0] if single else list(out)

    def on_cpu(*a):
        return on(results, a, attrs)

    if cuda is None or not cuda_built():
        return on_cpu(*args)

    def on_cuda(*a):
        own = cuda.results if cuda.results is not None else results
        single = isinstance(own, tuple)
        own = [own] if single else list(own)
        if cuda.workspace:
            own.append(((cuda.workspace,), np.uint8))
        handler_args = a if cuda.args is None else tuple(a[i] for i in cuda.args)
        out = on(own, handler_args, {**attrs, **(cuda.attrs or {})})
        out = out[:len(own) - (1 if cuda.workspace else 0)]
        out = out[0] if single else out
        return cuda.finish(out, a) if cuda.finish else out

    return jax.lax.platform_dependent(*args, cuda=on_cuda, default=on_cpu)


def _varying_type(args):
    """Inside shard_map, the results vary over every manual mesh axis an operand varies over. XLA
    cannot know it of a custom call, and a result typed invariant would let JAX scale its
    cotangent by the axis size where a psum follows. Returns the ShapeDtypeStruct arguments that
    say so (a type varying over manual axes needs the operands' mesh), or none."""
    return varying_type([jax.typeof(a) for a in args])


def varying_type(avals):
    """`_varying_type` from the operands' abstract values (a primitive's abstract evaluation)."""
    typed = [a for a in avals if getattr(a, "mat", None) is not None and a.mat.varying]
    if not typed:
        return {}
    varying = frozenset().union(*(a.mat.varying for a in typed))
    mesh = typed[0].sharding.mesh
    return {"manual_axis_type": type(typed[0].mat)(varying=varying),
            "sharding": jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())}


def placeholder():
    """The stand-in for an absent optional tensor (the handler is told by a has_* attribute)."""
    return jnp.zeros((0,), jnp.float32)


INT32_MAX = 2**31 - 1


def int_arg(fn, name, value, lo, hi=INT32_MAX, span=None):
    """An integer argument (a Python or NumPy int, or a concrete integer scalar array; not a bool
    and not a float: k = 2.7 is no k) in [lo, hi], as an int; errors name fn, the argument and the
    value (span: the range in words, as "[1, E]")."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{fn}: {name} = {value!r}: must be an integer, not a bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{fn}: {name} = {value!r}: must be an integer known when the function "
                        f"is traced") from None
    if not lo <= v <= hi:
        top = "2^31 - 1" if hi == INT32_MAX else str(hi)
        raise ValueError(f"{fn}: {name} = {v}: must be in " + (f"{span} = " if span else "")
                         + f"[{lo}, {top}]")
    return v


def float_arg(fn, name, value, *, positive=False, f32=True):
    """A real-number argument, finite (in float32 where f32: the kernels take it so) and > 0
    where positive, as a float; errors name fn, the argument and the value."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{fn}: {name} = {value!r}: must be a number, not a bool")
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: {name} = {value!r}: must be a real number known when the "
                        f"function is traced") from None
    top = float(np.finfo(np.float32).max) if f32 else math.inf
    if not (abs(v) <= top) or (positive and not v > 0):
        raise ValueError(f"{fn}: {name} = {value!r}: must be finite"
                         + (" in float32" if f32 else "") + (" and > 0" if positive else ""))
    return v


def bool_arg(fn, name, value):
    """A flag: True or False (a NumPy bool too), not a truthy string or number."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{fn}: {name} = {value!r}: must be True or False")
    return bool(value)


def check_float(fn, name, x):
    if np.dtype(x.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"{fn}: {name} dtype {x.dtype} is not float32 or bfloat16")


def check_rank(fn, name, x, rank, dims):
    if x.ndim != rank:
        raise ValueError(f"{fn}: {name} must be {dims}, got shape {tuple(x.shape)}")


def check_int_vector(fn, name, x):
    """x a rank-1 array of any integer dtype (as_int32 then checks its values)."""
    if x.ndim != 1 or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{fn}: {name} must be a rank-1 integer array, got "
                         f"{x.dtype}{list(x.shape)}")


def as_int32(fn, name, x):
    """x, an integer array, as int32: sizes, offsets and indices are int32 in every kernel. A
    wider type (int64 under jax_enable_x64, uint32, uint64) is checked value by value, never
    narrowed silently: a value that does not fit is a ValueError naming it at trace time where x
    is known then, and an error when the program runs where it is traced (on the CPU; on other
    backends a traced wider x is refused at trace time: pass int32)."""
    x = jnp.asarray(x)
    dt = np.dtype(x.dtype)
    if dt.kind not in "iu":
        raise TypeError(f"{fn}: {name} dtype {dt} is not an integer type")
    if dt == np.int32 or dt.itemsize < 4:
        return x.astype(jnp.int32)  # every value fits
    try:
        value = np.asarray(x)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        value = None
    if value is not None:
        bad = np.flatnonzero((value < np.iinfo(np.int32).min) | (value > np.iinfo(np.int32).max))
        if bad.size:
            index = tuple(int(i) for i in np.unravel_index(bad[0], value.shape))
            raise ValueError(f"{fn}: {name}{list(index)} = {value[index]} does not fit int32 "
                             f"(moekit's sizes, offsets and indices are int32)")
        return x.astype(jnp.int32)
    if jax.default_backend() != "cpu":
        raise TypeError(f"{fn}: {name} is a traced {dt} array; on {jax.default_backend()} "
                        f"moekit checks wider integers only where their values are known: pass "
                        f"int32")
    return call("moekit_to_int32", (x.shape, jnp.int32), x, what=f"{fn}: {name}")


def concrete_int(x):
    """The value of a scalar that is known at trace time, else None."""
    try:
        return int(np.asarray(x).reshape(()))
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError,
            TypeError):
        return None


def _varying_axes(x):
    """The manual mesh axes x varies over inside shard_map (jax 0.10: aval.mat.varying; older
    releases: aval.vma)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def vary_alike(args):
    """Inside shard_map: every operand cast to vary over the manual axes any of them varies over
    (JAX's transpose of the cast is a psum). Outside, the operands themselves."""
    have = [_varying_axes(x) for x in args]
    axes = frozenset().union(*have)
    return tuple(jax.lax.pcast(x, tuple(sorted(axes - h)), to="varying") if axes - h else x
                 for x, h in zip(args, have))


def match_vma(cotangents, primals):
    """Each cotangent typed as its primal is over the manual mesh axes inside `shard_map`.

    A custom_vjp must return cotangents of its primals' types. A weight's gradient computed
    from replicated activations varies over fewer axes than the sharded weight: it is cast to
    varying. A replicated input's gradient computed from sharded values varies over more: the
    input was implicitly broadcast to every device, so its cotangent is summed over them."""
    def one(ct, primal):
        want, have = _varying_axes(primal), _varying_axes(ct)
        extra, missing = tuple(sorted(have - want)), tuple(sorted(want - have))
        if extra:
            ct = jax.lax.psum(ct, extra)
        return jax.lax.pcast(ct, missing, to="varying") if missing else ct
    return tuple(one(c, p) for c, p in zip(cotangents, primals))
