"""The FFI plumbing shared by moekit.jax's modules: the jaxlib version check, the handlers'
registration for the CPU platform, and one helper per kind of call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moekit import _moekit_ffi


def _version(v):
    return tuple(int(x) for x in v.split(".")[:3] if x.isdigit())


if _version(jax.lib.__version__) < _version(_moekit_ffi.BUILT_WITH_JAXLIB):
    raise ImportError(
        f"moekit was built against the XLA FFI headers of jaxlib {_moekit_ffi.BUILT_WITH_JAXLIB}, "
        f"newer than the jaxlib {jax.lib.__version__} running now; reinstall moekit "
        f"(pip install --no-build-isolation .) with this jaxlib installed")

for _name, _capsule in _moekit_ffi.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")

FLOAT_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))

permute_max_rows = _moekit_ffi.permute_max_rows


def call(name, results, *args, **attrs):
    """One FFI call. `results` is one (shape, dtype) pair or a list of them (then a list comes
    back); attrs become the handler's attributes. Under vmap the batch runs as a loop of calls."""
    single = isinstance(results, tuple)
    structs = [jax.ShapeDtypeStruct(s, d) for s, d in ([results] if single else results)]
    out = jax.ffi.ffi_call(name, structs, vmap_method="sequential")(*args, **attrs)
    return out[0] if single else list(out)


def placeholder():
    """The stand-in for an absent optional tensor (the handler is told by a has_* attribute)."""
    return jnp.zeros((0,), jnp.float32)


def check_float(fn, name, x):
    if np.dtype(x.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"{fn}: {name} dtype {x.dtype} is not float32 or bfloat16")


def check_rank(fn, name, x, rank, dims):
    if x.ndim != rank:
        raise ValueError(f"{fn}: {name} must be {dims}, got shape {tuple(x.shape)}")


def concrete_int(x):
    """The value of a scalar that is known at trace time, else None."""
    try:
        return int(np.asarray(x).reshape(()))
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError,
            TypeError):
        return None
