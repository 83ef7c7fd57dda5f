"""A seeded property test of moekit.jax (issue 22, item 6), beside the C++ one (test_fuzz.cpp):
random shapes, group sizes, offsets and dtypes for ragged_dot (values and both gradients) and
permute / unpermute, against NumPy references written here; and random invalid calls, each
refused with an exception that names the call, never a crash. Bounded by a case count (each new
shape compiles): MOEKIT_FUZZ_CASES, 40 by default."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moekit.jax as mj

CASES = int(os.environ.get("MOEKIT_FUZZ_CASES", "40"))


def _ragged_dot_reference(lhs, rhs, sizes, offset):
    """out rows of local group j (offset <= j < offset + E_loc) = lhs rows @ rhs[j - offset]."""
    out = np.zeros((lhs.shape[0], rhs.shape[2]), np.float64)
    start = np.concatenate([[0], np.cumsum(sizes)])
    for j in range(offset, offset + rhs.shape[0]):
        rows = slice(start[j], start[j + 1])
        out[rows] = lhs[rows].astype(np.float64) @ rhs[j - offset].astype(np.float64)
    return out


def _draw(rng):
    G = int(rng.integers(1, 6))
    E_loc = int(rng.integers(1, G + 1))
    offset = int(rng.integers(0, G - E_loc + 1))
    sizes = rng.integers(0, 6, G)
    if rng.random() < 0.2:
        sizes = np.zeros(G, np.int64)
        sizes[rng.integers(0, G)] = rng.integers(0, 12)
    m = int(sizes.sum() + rng.integers(0, 3))
    K, n = (int(v) for v in rng.integers(1, 9, 2))
    dtype = jnp.float32 if rng.random() < 0.5 else jnp.bfloat16
    # bf16-exact values: products are exact, only sums are rounded.
    lhs = jnp.asarray(rng.uniform(-1, 1, (m, K)), jnp.bfloat16).astype(dtype)
    rhs = jnp.asarray(rng.uniform(-1, 1, (E_loc, K, n)), jnp.bfloat16).astype(dtype)
    return lhs, rhs, np.asarray(sizes, np.int32), offset


@pytest.mark.parametrize("seed", range(CASES))
def test_ragged_dot_random_cases(seed):
    rng = np.random.default_rng(seed)
    lhs, rhs, sizes, offset = _draw(rng)
    tol = dict(rtol=1e-5, atol=1e-5) if lhs.dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    f = lambda a, b: mj.ragged_dot(a, b, jnp.asarray(sizes), group_offset=offset)  # noqa: E731
    out, vjp = jax.vjp(f, lhs, rhs)
    a, b = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    np.testing.assert_allclose(np.asarray(out, np.float64),
                               _ragged_dot_reference(a, b, sizes, offset), **tol)
    ct = np.asarray(rng.uniform(-1, 1, out.shape), np.float32)
    d_lhs, d_rhs = vjp(jnp.asarray(ct, out.dtype))
    ct = np.asarray(jnp.asarray(ct, out.dtype), np.float64)
    # d_lhs = ct @ rhs[g]^T on the local rows; d_rhs[j] = lhs[rows of j]^T @ ct[rows of j].
    want_lhs = _ragged_dot_reference(ct, np.swapaxes(b, 1, 2), sizes, offset)
    start = np.concatenate([[0], np.cumsum(sizes)])
    want_rhs = np.stack([a[start[j]:start[j + 1]].T @ ct[start[j]:start[j + 1]]
                         for j in range(offset, offset + b.shape[0])])
    np.testing.assert_allclose(np.asarray(d_lhs, np.float64), want_lhs, **tol)
    np.testing.assert_allclose(np.asarray(d_rhs, np.float64), want_rhs, **tol)


@pytest.mark.parametrize("seed", range(CASES))
def test_ragged_dot_random_invalid_calls_are_named(seed):
    rng = np.random.default_rng(10_000 + seed)
    lhs, rhs, sizes, offset = _draw(rng)
    G, m = len(sizes), lhs.shape[0]
    # Traced values reach the kernel, which checks them, only where there are rows: XLA runs no
    # kernel for an empty result. Without rows, one of the trace-time mutations instead.
    kind = int(rng.integers(0 if m > 0 else 3, 6))
    if kind == 0:  # a negative size, traced: the kernel names it when the program runs
        sizes[rng.integers(0, G)] = -int(rng.integers(1, 4))
    elif kind == 1:  # sizes past the rows
        sizes[0] += m + 1
    elif kind == 2:  # an offset outside [0, G - E_loc], traced
        offset = -1 if rng.random() < 0.5 else G - rhs.shape[0] + 1
    elif kind == 3:
        rhs = rhs[:, :-1] if rhs.shape[1] > 1 else jnp.concatenate([rhs, rhs], axis=1)
    elif kind == 4:
        lhs = lhs.astype(jnp.int32)
    else:  # fewer groups than rhs holds
        sizes = sizes[:rhs.shape[0] - 1]
    f = jax.jit(lambda s, o: mj.ragged_dot(lhs, rhs, s, group_offset=o))
    with pytest.raises(Exception, match="ragged_dot"):
        jax.block_until_ready(f(jnp.asarray(sizes, jnp.int32), jnp.int32(offset)))


@pytest.mark.parametrize("seed", range(CASES))
def test_permute_round_trip_random_cases(seed):
    """permute then unpermute with the weights: each token's rows weighted and summed back
    (a kept slot contributes weight * x[t]; a dropped one nothing), against NumPy."""
    rng = np.random.default_rng(20_000 + seed)
    T, E = int(rng.integers(0, 9)), int(rng.integers(1, 7))
    k, H = int(rng.integers(1, min(E, 3) + 1)), int(rng.integers(1, 6))
    idx = np.array([rng.permutation(E)[:k] for _ in range(T)], np.int32).reshape(T, k)
    x = rng.uniform(-1, 1, (T, H)).astype(np.float32)
    w = rng.uniform(0, 1, (T, k)).astype(np.float32)
    align = int(rng.integers(1, 5))
    cf = None if rng.random() < 0.5 else float(rng.choice([0.25, 0.5, 1.0, 2.0]))
    p = mj.permute(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w), num_experts=E,
                   align_size=align, capacity_factor=cf, drop_policy="position")
    out = np.asarray(mj.unpermute(p.x, p, jnp.asarray(w)))
    # Which slots were kept: by position (token order), at most the capacity per expert.
    cap = None if cf is None else int(np.ceil(T * k / E * cf))
    kept, used = np.zeros((T, k), bool), np.zeros(E, np.int64)
    for t in range(T):
        for s in range(k):
            if cap is None or used[idx[t, s]] < cap:
                kept[t, s], used[idx[t, s]] = True, used[idx[t, s]] + 1
    want = (x[:, None, :] * (w * kept)[:, :, None]).sum(1)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    sizes = np.asarray(p.tokens_per_expert)
    assert (sizes % align == 0).all() and sizes.sum() <= p.x.shape[0]
    assert (sizes >= -(-used // align) * align).all()
