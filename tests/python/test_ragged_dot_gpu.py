"""moekit.jax.ragged_dot on an NVIDIA GPU (the CUDA FFI handlers) against jax.lax.ragged_dot and
the masked reference on the same GPU: values, both gradients, group_offset, jit, vmap, shard_map.

Every input is a multiple of 1/8 in [-1, 1] and every reference accumulates in float32: each
product and each partial sum is then exact in float32 (and TF32), so results in float32 must be
equal, not close, whatever the summation order. Results in the inputs' dtype are compared after
the same one rounding, so they must be equal too.

Skipped, with the reason, where JAX sees no GPU or moekit was built without CUDA.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import moekit.jax as mj
import test_ragged_dot
from test_ragged_dot import masked_reference


def _gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        return None


GPU = _gpu()
pytestmark = [
    pytest.mark.skipif(GPU is None, reason="no GPU visible to JAX (jax.devices('gpu') is empty)"),
    pytest.mark.skipif(not mj.cuda_built(),
                       reason="moekit was built without its CUDA backend"),
]

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
# The CPU suite's shapes, and two more whose K and n are multiples of 8 (the tensor-core kernels;
# the others take the portable one).
CASES = test_ragged_dot.CASES + [
    (111, 64, 40, [0, 0, 111, 0]),
    (777, 136, 264, [129, 0, 1, 255, 0, 392]),
]


def _on_gpu(x):
    return jax.device_put(x, GPU)


def _exact(shape, dtype, rng):
    """Multiples of 1/8 in [-1, 1]: exact in every float type here, and so are their products."""
    return _on_gpu(jnp.asarray(rng.integers(-8, 9, shape) / 8.0, dtype))


def _inputs(m, K, n, sizes, num_groups=None, dtype=BF16, seed=0):
    rng = np.random.default_rng(seed)
    lhs = _exact((m, K), dtype, rng)
    rhs = _exact((num_groups or len(sizes), K, n), dtype, rng)
    return lhs, rhs, _on_gpu(jnp.asarray(sizes, jnp.int32))


def _equal(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.devices() == {GPU}
    np.testing.assert_array_equal(np.float32(got), np.float32(want))


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("m,K,n,sizes", CASES)
def test_equals_jax_ragged_dot_on_the_gpu(m, K, n, sizes, dtype):
    lhs, rhs, gs = _inputs(m, K, n, sizes, dtype=dtype)
    for out_dtype in {F32, dtype}:
        got = mj.ragged_dot(lhs, rhs, gs, preferred_element_type=out_dtype)
        want = jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=F32).astype(out_dtype)
        _equal(got, want)

    # Gradients through sum(out * w): the cotangent is a multiple of 1/8 too.
    w = _exact((m, n), F32, np.random.default_rng(1))
    loss = lambda f: lambda a, b: jnp.sum(f(a, b, gs, preferred_element_type=F32) * w)
    got_g = jax.grad(loss(mj.ragged_dot), (0, 1))(lhs, rhs)
    # The reference's cotangents accumulate in f32, then round to the inputs' dtype once, as
    # moekit's do (the cotangent w is exact in every dtype here).
    want_g = jax.grad(loss(jax.lax.ragged_dot), (0, 1))(lhs, rhs)
    for g, r in zip(got_g, want_g):
        _equal(g, r)


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("m,K,n,sizes", CASES)
def test_n_k_weights_equal_jax_ragged_dot_general_on_the_gpu(m, K, n, sizes, dtype):
    """Weights [G, n, K], which the kernels read as they lie (rhs_transposed): values and both
    gradients equal jax.lax.ragged_dot_general's, the weight gradient [G, n, K] too."""
    lhs, rhs, gs = _inputs(m, K, n, sizes, dtype=dtype)
    rhs = jnp.swapaxes(rhs, 1, 2)  # [G, n, K]
    dn = test_ragged_dot.RHS_LAYOUT_DN["gnk"]
    call = lambda f: lambda a, b: f(a, b, gs, dn, preferred_element_type=F32)
    _equal(call(mj.ragged_dot_general)(lhs, rhs), call(jax.lax.ragged_dot_general)(lhs, rhs))
    w = _exact((m, n), F32, np.random.default_rng(1))
    loss = lambda f: lambda a, b: jnp.sum(call(f)(a, b) * w)
    got_g = jax.grad(loss(mj.ragged_dot_general), (0, 1))(lhs, rhs)
    want_g = jax.grad(loss(jax.lax.ragged_dot_general), (0, 1))(lhs, rhs)
    for g, r in zip(got_g, want_g):
        _equal(g, r)


@pytest.mark.parametrize("m,K,n,sizes", CASES[1:])
def test_group_offset_equals_masked_reference_on_the_gpu(m, K, n, sizes):
    num_groups = len(sizes)
    f = jax.jit(lambda a, b, s, o: mj.ragged_dot(a, b, s, preferred_element_type=F32,
                                                 group_offset=o))
    for num_local in sorted({1, max(1, num_groups // 2), num_groups}):
        for offset in range(num_groups - num_local + 1):
            lhs, rhs, gs = _inputs(m, K, n, sizes, num_groups=num_local, seed=offset)
            o = _on_gpu(jnp.int32(offset))  # traced: only the kernel reads it, on the device
            _equal(f(lhs, rhs, gs, o), masked_reference(lhs, rhs, gs, offset))

            w = _exact((m, n), F32, np.random.default_rng(2))
            got_g = jax.grad(lambda a, b: jnp.sum(
                mj.ragged_dot(a, b, gs, preferred_element_type=F32, group_offset=o) * w),
                (0, 1))(lhs, rhs)
            want_g = jax.grad(lambda a, b: jnp.sum(
                masked_reference(a, b, gs, offset) * w), (0, 1))(lhs, rhs)
            for g, r in zip(got_g, want_g):
                _equal(g, r)


def test_non_local_rows_are_never_read_on_the_gpu():
    sizes = [10, 0, 41, 0, 3, 57]
    lhs, rhs, gs = _inputs(111, 64, 40, sizes, num_groups=3)
    poisoned = lhs.at[:10].set(jnp.nan).at[51:].set(jnp.nan)
    got = np.float32(mj.ragged_dot(poisoned, rhs, gs, group_offset=1))
    assert np.isfinite(got).all()
    assert (got[:10] == 0).all() and (got[51:] == 0).all()
    want = masked_reference(lhs, rhs, gs, 1).astype(BF16)
    np.testing.assert_array_equal(got, np.float32(want))


def test_out_of_range_device_sizes_are_clamped_not_read_past():
    # On the GPU the sizes are never read on the host: a negative size counts as 0, and rows
    # past m are dropped from their group (moekit/ragged_dot.h). Same result as the clamped sizes.
    lhs, rhs, _ = _inputs(50, 64, 40, [1, 1, 1])
    bad = _on_gpu(jnp.asarray([20, -5, 100], jnp.int32))
    clamped = _on_gpu(jnp.asarray([20, 0, 30], jnp.int32))
    got = mj.ragged_dot(lhs, rhs, bad, preferred_element_type=F32)
    _equal(got, mj.ragged_dot(lhs, rhs, clamped, preferred_element_type=F32))
    _equal(got, jax.lax.ragged_dot(lhs, rhs, clamped, preferred_element_type=F32))


def test_vmap_on_the_gpu():
    lhs, rhs, gs = _inputs(50, 64, 40, [20, 0, 30])
    batch = jnp.stack([lhs, -lhs, 0.5 * lhs])
    got = jax.vmap(lambda a: mj.ragged_dot(a, rhs, gs, preferred_element_type=F32))(batch)
    want = jnp.stack([jax.lax.ragged_dot(a, rhs, gs, preferred_element_type=F32) for a in batch])
    _equal(got, want)


def test_expert_parallel_shard_map_over_the_gpus():
    # Every GPU holds E / devices experts at group_offset = its first one; psum adds the partial
    # outputs. With one GPU the mesh has one shard, which still lowers through shard_map.
    devices = jax.devices("gpu")
    shards = len(devices)
    E = 4 * shards
    sizes = list(np.random.default_rng(3).integers(0, 40, E))
    m = int(sum(sizes)) + 5
    lhs, rhs, gs = _inputs(m, 64, 40, sizes)
    mesh = Mesh(np.array(devices), ("ep",))

    def per_device(a, b):
        first = jax.lax.axis_index("ep") * (E // shards)
        return jax.lax.psum(
            mj.ragged_dot(a, b, gs, preferred_element_type=F32, group_offset=first), "ep")

    f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("ep")), out_specs=P()))
    got = f(jax.device_put(lhs, NamedSharding(mesh, P())),
            jax.device_put(rhs, NamedSharding(mesh, P("ep"))))
    want = jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=F32)
    np.testing.assert_array_equal(np.float32(got), np.float32(want))


_IN_A_CUDA_GRAPH = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    import moekit.jax as mj

    gpu = jax.devices("gpu")[0]
    rng = np.random.default_rng(0)
    exact = lambda shape, dtype: jax.device_put(
        jnp.asarray(rng.integers(-8, 9, shape) / 8.0, dtype), gpu)
    m, K, n, G, E = 96, 64, 40, 6, 3
    lhs, rhs = exact((m, K), jnp.bfloat16), exact((E, K, n), jnp.bfloat16)
    w = exact((m, n), jnp.float32)

    def step(f, a, b, s, o):
        loss = lambda a, b: jnp.sum(f(a, b, s, o) * w)
        return (f(a, b, s, o),) + jax.grad(loss, (0, 1))(a, b)

    def ours(a, b, s, o):
        return mj.ragged_dot(a, b, s, preferred_element_type=jnp.float32, group_offset=o)

    def masked(a, b, s, o):  # the local groups' weights among zeros: jax.lax.ragged_dot over G
        full = jax.lax.dynamic_update_slice(jnp.zeros((G, K, n), b.dtype), b, (o, 0, 0))
        return jax.lax.ragged_dot(a, full, s, preferred_element_type=jnp.float32)

    run = jax.jit(lambda *x: step(ours, *x))
    want = jax.jit(lambda *x: step(masked, *x))
    equal = []
    # Odd sizes, every row in one group, every row in the other shard's groups (no local
    # rows: all zeros), the same rows local, and rows left past sum(sizes).
    for sizes, offset in [([10, 0, 41, 0, 3, 37], 1), ([96, 0, 0, 0, 0, 0], 0),
                          ([0, 0, 0, 30, 30, 30], 0), ([0, 0, 0, 30, 30, 30], 3),
                          ([5, 7, 0, 11, 13, 2], 2)]:
        s = jax.device_put(jnp.asarray(sizes, jnp.int32), gpu)
        o = jax.device_put(jnp.int32(offset), gpu)
        for _ in range(3):  # the first run records the graph, the next ones replay it
            got = run(lhs, rhs, s, o)
            equal.append(all(bool((np.float32(a) == np.float32(b)).all())
                             for a, b in zip(got, want(lhs, rhs, s, o))))
    print(json.dumps({"equal": equal}))
""")


def test_results_stay_right_when_xla_captures_the_calls_in_a_cuda_graph():
    # The CUDA handlers are marked command-buffer compatible: XLA may record them into a CUDA
    # graph once and replay it, the host side never running again. The group sizes and offset
    # change between replays, on the device only, and every replay must still equal the masked
    # reference. The flags make XLA put even a single command in a graph (they must be set
    # before JAX starts, hence the subprocess). A handler that decided anything on the host
    # from the data, or made a call that stream capture forbids, fails here.
    flags = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
    done = subprocess.run([sys.executable, "-c", _IN_A_CUDA_GRAPH], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    equal = json.loads(done.stdout.strip().splitlines()[-1])["equal"]
    assert equal == [True] * 15
