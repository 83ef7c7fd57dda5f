"""moekit.jax.ragged_dot against jax.lax.ragged_dot (no offset) and against a pure-JAX masked
reference (with group_offset): values, both gradients, jit, vmap and the errors."""

import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import moekit.jax as mj

F32, BF16 = jnp.float32, jnp.bfloat16
# (m, K, n, group_sizes): odd sizes, empty groups, every row in one group, rows past the groups.
CASES = [
    (1, 1, 1, [1]),
    (7, 5, 3, [0, 7, 0]),
    (111, 33, 17, [10, 0, 41, 0, 3, 57]),
    (111, 33, 17, [0, 0, 111, 0]),
    (500, 64, 48, [100, 150, 0, 200, 25]),  # 25 rows past the last group
]


def _inputs(m, K, n, sizes, num_groups=None, dtype=F32, seed=0):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((m, K)), dtype)
    rhs = jnp.asarray(rng.standard_normal((num_groups or len(sizes), K, n)), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


def _tol(dtype, K):
    # f32: XLA's and oneDNN's summation orders; bf16: the result rounded to 8 bits.
    return dict(rtol=1e-5, atol=1e-5 * K) if dtype == F32 else dict(rtol=2e-2, atol=2e-2 * K**0.5)


def masked_reference(lhs, rhs_local, sizes, offset):
    """What users do today: all groups computed (zeros for the non-local weights), the
    non-local rows masked out afterwards."""
    num_groups, num_local = sizes.shape[0], rhs_local.shape[0]
    rhs_full = jnp.zeros((num_groups,) + rhs_local.shape[1:], rhs_local.dtype)
    rhs_full = jax.lax.dynamic_update_slice(rhs_full, rhs_local, (offset, 0, 0))
    out = jax.lax.ragged_dot(lhs, rhs_full, sizes, preferred_element_type=F32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    rows = jnp.arange(lhs.shape[0])
    local = (rows >= starts[offset]) & (rows < ends[offset + num_local - 1])
    return jnp.where(local[:, None], out, 0.0)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("m,K,n,sizes", CASES)
def test_equals_jax_ragged_dot_without_offset(m, K, n, sizes, dtype):
    lhs, rhs, gs = _inputs(m, K, n, sizes, dtype=dtype)
    got = mj.ragged_dot(lhs, rhs, gs)
    want = jax.lax.ragged_dot(lhs, rhs, gs)
    assert got.dtype == want.dtype == dtype
    np.testing.assert_allclose(np.float32(got), np.float32(want), **_tol(dtype, K))

    # Gradients, through a loss that weighs every output differently.
    w = jnp.asarray(np.random.default_rng(1).standard_normal((m, n)), dtype)
    loss = lambda f: lambda a, b: jnp.sum((f(a, b, gs) * w).astype(F32))
    got_g = jax.grad(loss(mj.ragged_dot), (0, 1))(lhs, rhs)
    want_g = jax.grad(loss(jax.lax.ragged_dot), (0, 1))(lhs, rhs)
    for g, r, k in zip(got_g, want_g, (n, m)):
        assert g.dtype == r.dtype
        np.testing.assert_allclose(np.float32(g), np.float32(r), **_tol(dtype, k))


@pytest.mark.parametrize("m,K,n,sizes", CASES[1:])
def test_group_offset_equals_masked_reference(m, K, n, sizes):
    num_groups = len(sizes)
    for num_local in {1, max(1, num_groups // 2), num_groups}:
        for offset in range(num_groups - num_local + 1):
            lhs, rhs, gs = _inputs(m, K, n, sizes, num_groups=num_local, seed=offset)
            got = jax.jit(lambda a, b, s, o: mj.ragged_dot(a, b, s, group_offset=o))(
                lhs, rhs, gs, jnp.int32(offset))
            want = masked_reference(lhs, rhs, gs, offset)
            np.testing.assert_allclose(got, want, **_tol(F32, K))

            w = jnp.asarray(np.random.default_rng(2).standard_normal((m, n)), F32)
            got_g = jax.grad(lambda a, b: jnp.sum(mj.ragged_dot(a, b, gs, group_offset=offset) * w),
                             (0, 1))(lhs, rhs)
            want_g = jax.grad(lambda a, b: jnp.sum(masked_reference(a, b, gs, offset) * w),
                              (0, 1))(lhs, rhs)
            np.testing.assert_allclose(got_g[0], want_g[0], **_tol(F32, n))
            np.testing.assert_allclose(got_g[1], want_g[1], **_tol(F32, m))


def test_offset_as_shape_one_array_and_traced_under_jit():
    lhs, rhs, gs = _inputs(111, 33, 17, [10, 0, 41, 0, 3, 57], num_groups=2)
    want = masked_reference(lhs, rhs, gs, 2)
    f = jax.jit(lambda a, b, s, o: mj.ragged_dot(a, b, s, group_offset=o))
    np.testing.assert_allclose(f(lhs, rhs, gs, jnp.array([2], jnp.int32)), want,
                               **_tol(F32, 33))
    np.testing.assert_allclose(f(lhs, rhs, gs, jnp.int32(2)), want, **_tol(F32, 33))


def test_non_local_rows_are_never_read():
    lhs, rhs, gs = _inputs(111, 33, 17, [10, 0, 41, 0, 3, 57], num_groups=3)
    ends = np.cumsum([10, 0, 41, 0, 3, 57])
    # Local groups 1..3 hold rows [10, 51); everything else becomes NaN.
    poisoned = lhs.at[:10].set(jnp.nan).at[51:].set(jnp.nan)
    got = mj.ragged_dot(poisoned, rhs, gs, group_offset=1)
    assert np.isfinite(np.asarray(got)).all()
    assert (np.asarray(got)[:10] == 0).all() and (np.asarray(got)[ends[3]:] == 0).all()


def test_check_grads_numerically():
    lhs, rhs, gs = _inputs(23, 5, 4, [7, 0, 9, 5], num_groups=2)
    check_grads(lambda a, b: mj.ragged_dot(a, b, gs, group_offset=1), (lhs, rhs), order=1,
                modes=["rev"], atol=1e-2, rtol=1e-2)


def test_preferred_element_type_f32_from_bf16():
    lhs, rhs, gs = _inputs(111, 33, 17, [10, 0, 41, 0, 3, 57], dtype=BF16)
    got = mj.ragged_dot(lhs, rhs, gs, preferred_element_type=F32)
    want = jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=F32)
    assert got.dtype == F32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def _forward(layout):
    """(the forward on weights [G, K, n] (kn) or [G, n, K] (nk), JAX's own) as f(lhs, rhs, gs),
    and the weights of that layout from [G, K, n] ones."""
    if layout == "kn":
        return mj.ragged_dot, jax.lax.ragged_dot, lambda w: w
    dn = RHS_LAYOUT_DN["gnk"]
    return (lambda a, b, s: mj.ragged_dot_general(a, b, s, dn),
            lambda a, b, s: jax.lax.ragged_dot_general(a, b, s, dn),
            lambda w: jnp.swapaxes(w, 1, 2))


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_vmap_over_a_leading_batch_dimension(layout):
    f, reference, as_layout = _forward(layout)
    lhs, rhs, gs = _inputs(50, 8, 6, [20, 0, 30])
    rhs = as_layout(rhs)
    batch = jnp.stack([lhs, 2 * lhs, -lhs])
    got = jax.vmap(lambda a: f(a, rhs, gs))(batch)
    # jax.lax.ragged_dot has no batching rule for this; a loop is the reference.
    want = jnp.stack([reference(a, rhs, gs) for a in batch])
    np.testing.assert_allclose(got, want, **_tol(F32, 8))
    # Batched weights too (each batch element its own weights, in the layout given).
    weights = jnp.stack([rhs, -2 * rhs])
    got = jax.vmap(lambda b: f(lhs, b, gs))(weights)
    want = jnp.stack([reference(lhs, b, gs) for b in weights])
    np.testing.assert_allclose(got, want, **_tol(F32, 8))


@pytest.mark.parametrize("kwargs,kind,words", [
    (dict(lhs=np.zeros((3,), np.float32)), ValueError, "lhs must be [m, K]"),
    (dict(rhs=np.zeros((2, 4, 3), np.float32)), ValueError, "rhs.shape[1] = 4"),
    (dict(rhs=np.zeros((2, 5, 3), np.int8)), TypeError, "rhs dtype int8"),
    (dict(lhs=np.zeros((7, 5), np.int32)), TypeError, "lhs dtype int32"),
    (dict(group_sizes=np.array([[7]], np.int32)), ValueError, "group_sizes must be a rank-1"),
    (dict(group_sizes=np.array([3, 2, 2], np.int32)), ValueError, "has 3 groups but rhs holds 2"),
    (dict(group_sizes=np.array([3, 2, 2], np.int32), group_offset=2), ValueError,
     "group_offset = 2 is outside [0, 1]"),
    (dict(group_offset=np.zeros((2,), np.int32)), ValueError, "group_offset must be"),
    (dict(preferred_element_type=jnp.int32), TypeError, "preferred_element_type int32"),
    # moekit's old fourth place was group_offset; JAX's (and now moekit's) is precision.
    (dict(precision=1), TypeError, "pass group_offset= by keyword"),
    (dict(precision=jnp.int32(1)), TypeError, "pass group_offset= by keyword"),
])
def test_invalid_arguments_are_named_at_trace_time(kwargs, kind, words):
    args = dict(lhs=np.zeros((7, 5), np.float32), rhs=np.zeros((2, 5, 3), np.float32),
                group_sizes=np.array([3, 4], np.int32))
    args.update(kwargs)
    with pytest.raises(kind, match=re.escape(words)):
        mj.ragged_dot(**args)


@pytest.mark.parametrize("sizes,offset,words", [
    ([3, -1], 0, "group_sizes[1] = -1"),
    ([5, 4], 0, "group_sizes"),  # 9 rows of 7
    ([3, 4, 0], 2, "group_offset = 2"),  # traced, so only the kernel sees it
])
def test_invalid_data_raises_at_run_time(sizes, offset, words):
    lhs, rhs, _ = _inputs(7, 5, 3, [7], num_groups=2)
    f = jax.jit(lambda o: mj.ragged_dot(lhs, rhs, jnp.asarray(sizes, jnp.int32), group_offset=o))
    with pytest.raises(Exception, match=re.escape(words)):
        f(jnp.int32(offset)).block_until_ready()


# The signature and dtype rules of jax.lax.ragged_dot: positional precision, promotion of mixed
# inputs, any float result, float16 (computed in float32 on the CPU).
DTYPE_CASES = [
    (BF16, F32, None), (F32, BF16, None), (BF16, BF16, jnp.float16), (F32, F32, BF16),
    (F32, F32, jnp.float16), (jnp.float16, jnp.float16, None), (jnp.float16, F32, None),
    (jnp.float16, jnp.float16, F32), (BF16, jnp.float16, None),
]


@pytest.mark.parametrize("lhs_dtype,rhs_dtype,out_dtype", DTYPE_CASES)
def test_dtype_rules_are_jax_ragged_dots(lhs_dtype, rhs_dtype, out_dtype):
    lhs, rhs, gs = _inputs(111, 33, 17, [10, 0, 41, 0, 3, 57])
    lhs, rhs = lhs.astype(lhs_dtype), rhs.astype(rhs_dtype)
    got = mj.ragged_dot(lhs, rhs, gs, preferred_element_type=out_dtype)
    want = jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=out_dtype)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    exact = np.dtype(want.dtype) == np.dtype(F32) and lhs_dtype == rhs_dtype == F32
    tol = _tol(F32, 33) if exact else dict(rtol=2e-2, atol=2e-2 * 33**0.5)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)
    # The gradients arrive in each input's own dtype, as JAX's do.
    grads = jax.grad(lambda a, b: mj.ragged_dot(a, b, gs, preferred_element_type=out_dtype)
                     .astype(F32).sum(), (0, 1))(lhs, rhs)
    want_grads = jax.grad(lambda a, b: jax.lax.ragged_dot(
        a, b, gs, preferred_element_type=out_dtype).astype(F32).sum(), (0, 1))(lhs, rhs)
    for g, w in zip(grads, want_grads):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=2e-2, atol=2e-2 * 111**0.5)


def test_precision_is_the_fourth_argument_as_in_jax():
    lhs, rhs, gs = _inputs(50, 8, 6, [20, 0, 30])
    for precision in (jax.lax.Precision.HIGHEST, "highest", ("default", "highest"), None):
        got = mj.ragged_dot(lhs, rhs, gs, precision)
        want = jax.lax.ragged_dot(lhs, rhs, gs, precision)
        np.testing.assert_allclose(got, want, **_tol(F32, 8))
    # And group_offset by keyword after it, as JAX documents it.
    got = mj.ragged_dot(lhs, rhs[1:], gs, None, F32, group_offset=1)
    np.testing.assert_allclose(got, masked_reference(lhs, rhs[1:], gs, 1), **_tol(F32, 8))


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("m", [0, 6])
def test_no_rows_in_any_group_gives_zeros_and_zero_gradients(m, layout):
    # m = 0: empty lhs; m = 6: every group empty, so no row is computed.
    f, _, as_layout = _forward(layout)
    lhs, rhs, gs = _inputs(m, 5, 4, [0, 0, 0])
    rhs = as_layout(rhs)
    out = f(lhs, rhs, gs)
    assert out.shape == (m, 4) and not np.asarray(out).any()
    d_lhs, d_rhs = jax.grad(lambda a, b: f(a, b, gs).sum(), (0, 1))(lhs, rhs)
    assert d_lhs.shape == lhs.shape and not np.asarray(d_lhs).any()
    assert d_rhs.shape == rhs.shape and not np.asarray(d_rhs).any()


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_bench_script_runs_and_prints_its_json(layout):
    # bench/jax_ragged_dot.py at a tiny size: one object per (impl, shards, mode, pass) case:
    # moekit's full call (masked needs shards), then shard 0 alone and all 4 under shard_map;
    # the weights [E, K, n] or [E, n, K]. --dims, not a preset: qwen3-30b-a3b's weights took
    # 11 GiB here (the masked shards' zeros and gradients), two such tests at once more than
    # CI's machine holds.
    script = pathlib.Path(__file__).parents[2] / "bench" / "jax_ragged_dot.py"
    done = subprocess.run([sys.executable, str(script), "--tokens", "2", "--reps", "1",
                           "--impls", "moekit,masked", "--shards", "1,4", "--rhs-layout", layout,
                           "--dims", "40,24,8,8", "--json"],
                          capture_output=True, text=True, check=True)
    cases = json.loads(done.stdout)
    assert len(cases) == 2 + 2 * 2 * 2
    for c in cases:
        assert {"impl", "pass", "shards", "mode", "preset", "tokens", "device", "rows", "ms",
                "tflops"} <= c.keys()
        assert c["rhs_layout"] == layout and c["preset"] == "dims"
        assert c["ms"] > 0 and c["tflops"] > 0 and c["pass"] in ("fwd", "fwd+bwd")
        assert c["vs_moekit"] > 0
    assert {c["mode"] for c in cases if c["shards"] == 4} == {"shard0", "spmd"}
    # 2 tokens x k = 8 rows: all of them computed in the full call and under shard_map.
    assert {c["rows"] for c in cases if c["mode"] in ("all", "spmd")} == {16}


@pytest.mark.parametrize("dims", ["40,24,8", "40,24,0,8", "40,x,8,8"])
def test_bench_script_refuses_bad_dims_naming_them(dims):
    script = pathlib.Path(__file__).parents[2] / "bench" / "jax_ragged_dot.py"
    refused = subprocess.run([sys.executable, str(script), "--dims", dims],
                             capture_output=True, text=True)
    assert refused.returncode == 2 and f"--dims {dims}:" in refused.stderr


def test_library_holds_the_cuda_handlers_exactly_when_built_with_cuda():
    # Every op has a CPU handler; in a CUDA build every op of the layer also has a CUDA one,
    # under the same name (one ffi_call runs on either platform). CPU only: the wide-integer
    # check (a GPU refuses traced wide integers at trace time), the fixed-block EP layouts and
    # the whole layer in one call (moe_layer runs the steps on a GPU), and the forward on packed
    # weights (a CPU layout).
    from moekit.jax import _ffi
    targets = [(name, platform) for name, platform, _ in _ffi.targets()]
    assert len(set(targets)) == len(targets)
    cpu = {name for name, platform in targets if platform == "cpu"}
    cpu_only = {"moekit_to_int32", "moekit_ep_pack", "moekit_ep_unpack", "moekit_ep_regroup",
                "moekit_ep_ungroup", "moekit_layer_fwd", "moekit_layer_bwd",
                "moekit_ragged_dot_fwd_packed"}
    assert {"moekit_ragged_dot_fwd", "moekit_route_fwd", "moekit_permute_fwd",
            "moekit_activation_fwd"} <= cpu and cpu_only <= cpu
    cuda = {name for name, platform in targets if platform == "CUDA"}
    assert cuda == (cpu - cpu_only if mj.cuda_built() else set())
    assert {platform for _, platform in targets} <= {"cpu", "CUDA"}


def _custom_calls(lowered_text):
    """{target: [result types]} of the moekit custom calls in StableHLO text."""
    calls = {}
    for line in lowered_text.splitlines():
        found = re.search(r"stablehlo\.custom_call @(moekit_\w+)\(.*->\s*\(?(.*?)\)?$", line)
        if found:
            calls.setdefault(found[1], []).append(re.findall(r"tensor<[^>]*>", found[2]))
    return calls


@pytest.mark.skipif(not mj.cuda_built(), reason="moekit was built without its CUDA backend")
@pytest.mark.parametrize("E_loc", [3, 0])
def test_cuda_lowering_gives_each_call_its_workspace_and_the_cpu_lowering_none(E_loc):
    # Lowered for CUDA (possible without a GPU), every ragged_dot call has a second result: its
    # workspace, uint8 of the size the library asks for E_loc, so that the handler allocates
    # nothing and XLA may capture it in a CUDA graph. Lowered for the CPU, the one result alone.
    # E_loc = 0: a shard with no local groups still gets a workspace (for the plan's bounds).
    from moekit.jax import _ffi
    m, K, n = 37, 16, 24
    lhs, rhs = jnp.ones((m, K), jnp.bfloat16), jnp.ones((E_loc, K, n), jnp.bfloat16)
    sizes = jnp.asarray([5, 0, 9, 11, 2], jnp.int32)
    loss = lambda a, b: mj.ragged_dot(a, b, sizes, preferred_element_type=jnp.float32,
                                               group_offset=1).sum()
    both = jax.jit(jax.value_and_grad(loss, (0, 1))).trace(lhs, rhs)
    workspace = f"tensor<{_ffi.cuda_workspace_bytes(E_loc)}xui8>"
    want = {"moekit_ragged_dot_fwd": [["tensor<37x24xf32>", workspace]],
            "moekit_ragged_dot_dlhs": [["tensor<37x16xbf16>", workspace]],
            "moekit_ragged_dot_drhs": [[f"tensor<{E_loc}x16x24xbf16>", workspace]]}
    assert _custom_calls(both.lower(lowering_platforms=("cuda",)).as_text()) == want
    on_cpu = {name: [types[:1]] for name, [types] in want.items()}
    assert _custom_calls(both.lower(lowering_platforms=("cpu",)).as_text()) == on_cpu
    # The workspace covers what the kernels need, plus the slack that aligns it to 256 bytes.
    assert _ffi.cuda_workspace_bytes(E_loc) > 255
    assert _ffi.cuda_workspace_bytes(64) > _ffi.cuda_workspace_bytes(E_loc)
    assert _ffi.cuda_workspace_bytes(-1) == 0


def _dn(contract, ragged, groups):
    return jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(contract, ([], [])),
                                             lhs_ragged_dimensions=ragged,
                                             rhs_group_dimensions=groups)


# (lhs layout, rhs layout, dimension numbers): the forward in every layout of its operands, and
# the weight gradient (ragged contraction) likewise.
GENERAL_CASES = [
    ("mk", "gkn", _dn(([1], [1]), [0], [0])),
    ("mk", "gnk", _dn(([1], [2]), [0], [0])),
    ("km", "kgn", _dn(([0], [0]), [1], [1])),
    ("mk", "mn", _dn(([0], [0]), [0], [])),
    ("km", "nm", _dn(([1], [1]), [1], [])),
]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("lhs_layout,rhs_layout,dn", GENERAL_CASES)
def test_ragged_dot_general_equals_jax(lhs_layout, rhs_layout, dn, dtype):
    m, K, n, sizes = 111, 33, 17, [10, 0, 41, 0, 3, 57]
    rng = np.random.default_rng(5)
    dims = dict(m=m, k=K, n=n, g=len(sizes))
    lhs = jnp.asarray(rng.standard_normal([dims[c] for c in lhs_layout]), dtype)
    rhs = jnp.asarray(rng.standard_normal([dims[c] for c in rhs_layout]), dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    got = mj.ragged_dot_general(lhs, rhs, gs, dn)
    want = jax.lax.ragged_dot_general(lhs, rhs, gs, dn)
    assert got.shape == want.shape and got.dtype == want.dtype
    rows = m if "g" in rhs_layout else n
    np.testing.assert_allclose(np.float32(got), np.float32(want), **_tol(dtype, max(K, rows)))
    w = jnp.asarray(rng.standard_normal(want.shape), F32)
    loss = lambda f: lambda a, b: jnp.sum(f(a, b, gs, dn).astype(F32) * w)  # noqa: E731
    got_g = jax.grad(loss(mj.ragged_dot_general), (0, 1))(lhs, rhs)
    reference = jax.lax.ragged_dot_general
    if "g" not in rhs_layout:  # JAX cannot differentiate its ragged contraction: a masked einsum
        def reference(a, b, gs, dn):
            a, b = (x if x.shape[0] == m else x.T for x in (a, b))  # [m, K], [m, n]
            ends = jnp.cumsum(gs)
            rows = jnp.arange(m)
            mask = ((rows >= (ends - gs)[:, None]) & (rows < ends[:, None])).astype(a.dtype)
            return jnp.einsum("gm,mk,mn->gkn", mask, a, b, preferred_element_type=F32).astype(
                a.dtype)
        np.testing.assert_allclose(np.float32(reference(lhs, rhs, gs, dn)), np.float32(want),
                                   **_tol(dtype, m))
    want_g = jax.grad(loss(reference), (0, 1))(lhs, rhs)
    for g, r in zip(got_g, want_g):
        assert g.shape == r.shape and g.dtype == r.dtype
        np.testing.assert_allclose(np.float32(g), np.float32(r), **_tol(dtype, m))


# rhs layouts of the forward, as ragged_dot_general's dimension numbers take them.
RHS_LAYOUT_DN = {"gkn": _dn(([1], [1]), [0], [0]), "gnk": _dn(([1], [2]), [0], [0]),
                 "kgn": _dn(([1], [0]), [0], [1])}


@pytest.mark.parametrize("rhs_layout,transposed", [("gkn", "false"), ("gnk", "true"),
                                                   ("kgn", "false")])
def test_ragged_dot_general_reads_n_k_weights_as_they_lie(rhs_layout, transposed):
    """rhs [G, n, K] (a linear layer's [out, in] weight per expert) reaches every kernel as it
    lies: the forward and both gradients' custom calls say rhs_transposed = true and the program
    transposes nothing. [G, K, n] is the kernels' own layout; any other order is transposed to it
    first (the one copy left)."""
    m, K, n, sizes = 20, 6, 5, [7, 0, 13]
    dims = dict(m=m, k=K, n=n, g=len(sizes))
    lhs = jnp.ones((m, K), F32)
    rhs = jnp.ones([dims[c] for c in rhs_layout], F32)
    gs = jnp.asarray(sizes, jnp.int32)
    loss = lambda a, b: mj.ragged_dot_general(a, b, gs, RHS_LAYOUT_DN[rhs_layout]).sum()
    text = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(lhs, rhs).as_text()
    calls = re.findall(r"custom_call @moekit_ragged_dot_(\w+)\(.*rhs_transposed = (\w+)", text)
    assert sorted(calls) == [("dlhs", transposed), ("drhs", transposed), ("fwd", transposed)]
    assert ("stablehlo.transpose" in text) == (rhs_layout == "kgn"), text


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("m,K,n,sizes", CASES[1:])
def test_n_k_weights_with_group_offset_equal_the_masked_reference(m, K, n, sizes, dtype):
    """[G, n, K] weights of a subset of the groups (group_offset, traced): the forward and both
    gradients equal the masked reference on the same weights as [G, K, n]; the weight gradient
    comes back [G, n, K]."""
    num_groups = len(sizes)
    dn = RHS_LAYOUT_DN["gnk"]
    for num_local in {1, num_groups}:
        for offset in sorted({0, num_groups - num_local}):
            lhs, rhs, gs = _inputs(m, K, n, sizes, num_groups=num_local, dtype=dtype, seed=offset)
            rhs_t = jnp.swapaxes(rhs, 1, 2)  # [E_loc, n, K]
            f = jax.jit(lambda a, b, s, o: mj.ragged_dot_general(
                a, b, s, dn, preferred_element_type=F32, group_offset=o))
            np.testing.assert_allclose(f(lhs, rhs_t, gs, jnp.int32(offset)),
                                       masked_reference(lhs, rhs, gs, offset), **_tol(dtype, K))
            w = jnp.asarray(np.random.default_rng(2).standard_normal((m, n)), F32)
            got = jax.grad(lambda a, b: jnp.sum(f(a, b, gs, jnp.int32(offset)) * w),
                           (0, 1))(lhs, rhs_t)
            want = jax.grad(lambda a, b: jnp.sum(masked_reference(a, b, gs, offset) * w),
                            (0, 1))(lhs, rhs)
            assert got[1].shape == rhs_t.shape and got[1].dtype == dtype
            np.testing.assert_allclose(np.float32(got[0]), np.float32(want[0]), **_tol(dtype, n))
            np.testing.assert_allclose(np.float32(got[1]), np.float32(jnp.swapaxes(want[1], 1, 2)),
                                       **_tol(dtype, m))


def test_n_k_weights_error_names_their_contraction_dimension():
    lhs, rhs, gs = _inputs(50, 8, 6, [20, 0, 30])  # rhs [3, 8, 6]: K = 8 is dim 1, not 2
    with pytest.raises(ValueError, match=r"ragged_dot_general: rhs.shape\[2\] = 6 differs from "
                                         r"lhs.shape\[1\] = 8"):
        mj.ragged_dot_general(lhs, rhs, gs, RHS_LAYOUT_DN["gnk"])


def test_ragged_dot_general_names_what_it_does_not_take():
    lhs, rhs, gs = _inputs(50, 8, 6, [20, 0, 30])
    batch = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([2], [2]), ([0], [0])), lhs_ragged_dimensions=[1],
        rhs_group_dimensions=[1])
    with pytest.raises(NotImplementedError, match="no batch dimensions"):
        mj.ragged_dot_general(lhs[None], rhs[None], gs, batch)
    with pytest.raises(NotImplementedError, match="group_offset with a ragged contraction"):
        mj.ragged_dot_general(lhs, lhs, gs, _dn(([0], [0]), [0], []), group_offset=1)


# Every transformation jax.lax.ragged_dot has (and those its own implementation fails): the
# kernels are primitives whose JVPs are themselves and whose transposes are each other.
def _dense(lhs, rhs, sizes, offset=0):
    """The local groups' rows times their matrices, other rows 0, by slicing: JAX differentiates
    it any way."""
    starts = np.concatenate([[0], np.cumsum(sizes)])
    out = jnp.zeros((lhs.shape[0], rhs.shape[2]), jnp.float32)
    for j in range(offset, offset + rhs.shape[0]):
        rows = slice(int(starts[j]), int(starts[j + 1]))
        out = out.at[rows].set(lhs[rows] @ rhs[j - offset])
    return out


@pytest.mark.parametrize("offset", [0, 1])
def test_every_transformation_equals_the_dense_reference(offset):
    sizes = [3, 0, 6, 2]
    lhs, rhs, gs = _inputs(13, 5, 3, sizes, num_groups=4 - offset)
    mine = lambda a, b: mj.ragged_dot(a, b, gs, group_offset=offset if offset else None)  # noqa
    ref = lambda a, b: _dense(a, b, sizes, offset)  # noqa: E731
    tol = dict(rtol=1e-5, atol=1e-5)
    scalar = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b)))  # noqa: E731
    t = (jnp.cos(lhs), jnp.sin(rhs))
    checks = {
        "jvp": lambda f: jax.jvp(f, (lhs, rhs), t)[1],
        "grad of grad": lambda f: jax.grad(
            lambda b: jnp.sum(jax.grad(scalar(f), 0)(lhs, b) ** 2))(rhs),
        "hessian": lambda f: jax.hessian(lambda a: scalar(f)(a, rhs))(lhs),
        "jit(hessian) in rhs": lambda f: jax.jit(jax.hessian(lambda b: scalar(f)(lhs, b)))(rhs),
        "jacfwd": lambda f: jax.jacfwd(lambda b: f(lhs, b))(rhs),
        "linear_transpose": lambda f: jax.linear_transpose(
            lambda a: f(a, rhs), lhs)(jnp.ones((13, 3)))[0],
        "checkpoint": lambda f: jax.grad(
            lambda a: jnp.sum(jax.checkpoint(lambda a: jnp.sin(f(a, rhs)))(a)))(lhs),
        "vmap of grad": lambda f: jax.vmap(jax.grad(scalar(f), 1), in_axes=(0, None))(
            jnp.stack([lhs, -2 * lhs]), rhs),
        "grad of vmap": lambda f: jax.grad(lambda b: jnp.sum(jax.vmap(
            lambda a: f(a, b))(jnp.stack([lhs, lhs + 1]))))(rhs),
    }
    for name, check in checks.items():
        want = check(ref)
        # f32 sums in another order (oneDNN's, XLA's), relative to the largest value: a small
        # element of a second derivative is a difference of large terms.
        scale = max(1.0, float(jnp.abs(want).max()))
        np.testing.assert_allclose(check(mine), want, err_msg=name, rtol=tol["rtol"],
                                   atol=tol["atol"] * scale)


def _in_fresh_process(devices, code):
    """Runs `code` in a new Python with `devices` CPU devices; it prints "ok" when it passes."""
    head = (f"import os\nos.environ['XLA_FLAGS'] = "
            f"'--xla_force_host_platform_device_count={devices}'\n")
    run = subprocess.run([sys.executable, "-c", head + code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr


def test_replicated_rows_and_sharded_experts_under_shard_map():
    """Gradients reach a replicated lhs (summed over the axis) and an expert-sharded rhs with a
    traced offset, in a fresh process with 2 CPU devices."""
    _in_fresh_process(2, '''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import moekit.jax as mj
mesh = Mesh(np.array(jax.devices()), ("ep",))
rng = np.random.default_rng(0)
sizes = np.array([3, 0, 6, 2], np.int32)
lhs = jnp.asarray(rng.standard_normal((12, 5)), jnp.float32)
rhs = jnp.asarray(rng.standard_normal((4, 5, 3)), jnp.float32)
def f(a, b, s):
    out = mj.ragged_dot(a, b, s, group_offset=jax.lax.axis_index("ep") * 2)
    return jax.lax.psum(out, "ep")
sharded = jax.shard_map(f, mesh=mesh, in_specs=(P(), P("ep"), P()), out_specs=P())
loss = lambda g: lambda a, b: jnp.sum(jnp.sin(g(a, b, jnp.asarray(sizes))))
one = lambda a, b, s: mj.ragged_dot(a, b, s)
for i in (0, 1):
    got = jax.jit(jax.grad(loss(sharded), i))(lhs, rhs)
    want = jax.grad(loss(one), i)(lhs, rhs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
print("ok")
''')


# What the sharded-jit tests run first, in a fresh process with 4 CPU devices: a 2 x 2 (dp, tp)
# mesh, S(*spec) a sharding on it, and the group sizes and lhs [12, 6] they share.
_MESH_2X2 = '''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import moekit.jax as mj
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("dp", "tp"))
S = lambda *spec: NamedSharding(mesh, P(*spec))
rng = np.random.default_rng(0)
sizes = jnp.asarray([3, 0, 6, 2], jnp.int32)
lhs = jnp.asarray(rng.standard_normal((12, 6)), jnp.float32)
'''


def test_sharded_jit_keeps_the_weights_and_rows_sharded():
    """Under jit with shardings on a 2 x 2 mesh (dp, tp), the forward and both gradients equal
    jax.lax.ragged_dot's, and the compiled program gathers neither the weights nor the rows
    where they are sharded over n (tensor parallel), over rows (data parallel), both, or over
    the contraction K; where rows and n share an axis, n keeps it. Then offsets (traced, bf16,
    rows past the groups), one group holding every row, the batch-invariant mode's bits over
    sharded rows, and a refused group total on sharded rows."""
    _in_fresh_process(4, _MESH_2X2 + '''
rhs = jnp.asarray(rng.standard_normal((4, 6, 8)), jnp.float32)
ct = jnp.asarray(rng.standard_normal((12, 8)), jnp.float32)
def compiled(f, shardings, *args):
    g = jax.jit(f, in_shardings=shardings)
    return g(*args), g.lower(*args).compile().as_text()
cases = {"n over tp": (S(), S(None, None, "tp"), True),
         "rows over dp": (S("dp"), S(), True),
         "rows over dp, n over tp": (S("dp"), S(None, None, "tp"), True),
         "K over tp": (S(None, "tp"), S(None, "tp"), True),
         "rows and n over tp": (S("tp"), S(None, None, "tp"), False)}
for name, (lhs_s, rhs_s, no_gather) in cases.items():
    for impl in (jax.lax.ragged_dot, mj.ragged_dot):
        fwd, fwd_hlo = compiled(impl, (lhs_s, rhs_s, S()), lhs, rhs, sizes)
        loss = lambda a, b: jnp.sum(impl(a, b, sizes) * ct)
        grads, grad_hlo = compiled(jax.grad(loss, (0, 1)), (lhs_s, rhs_s), lhs, rhs)
        if impl is jax.lax.ragged_dot:
            want = (fwd, *grads)
    for got, ref in zip((fwd, *grads), want):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5, err_msg=name)
    for hlo in (fwd_hlo, grad_hlo):
        gathers = [line for line in hlo.splitlines() if " all-gather(" in line]
        assert not any("f32[4,6,8]" in line for line in gathers), (name, gathers)  # the weights
        assert not (no_gather and gathers), (name, gathers)

dp_tp = (S("dp"), S(None, None, "tp"), S(), S())
f = lambda a, b, s, o: mj.ragged_dot(a, b, s, group_offset=o)
sizes = jnp.asarray([3, 0, 6, 2, 1], jnp.int32)  # 12 of 14 rows
lhs = jnp.asarray(rng.standard_normal((14, 6)), jnp.bfloat16)
rhs = jnp.asarray(rng.standard_normal((2, 6, 8)), jnp.bfloat16)
for offset in (0, 2, 3):
    args = (lhs, rhs, sizes, jnp.int32(offset))
    np.testing.assert_array_equal(jax.jit(f, in_shardings=dp_tp)(*args), f(*args))
    loss = lambda a, b: jnp.sum(f(a, b, sizes, offset).astype(jnp.float32) ** 2)
    grad = jax.grad(loss, (0, 1))
    for got, want in zip(jax.jit(grad, in_shardings=dp_tp[:2])(lhs, rhs), grad(lhs, rhs)):
        np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=2e-2, atol=2e-2)
# Every row in one group, which spans both row shards (offset 1), or in no local group (3).
for offset in (1, 3):
    args = (lhs, rhs, jnp.asarray([0, 14, 0, 0, 0], jnp.int32), jnp.int32(offset))
    np.testing.assert_array_equal(jax.jit(f, in_shardings=dp_tp)(*args), f(*args))
# The batch-invariant mode is data-parallel invariant too: rows sharded over dp give each row
# the bits of the one-device call, forward and input gradient (f32, K = 160, n = 136: sizes at
# which the default mode's rows differ). Rows only: the mode promises nothing over a split of the
# columns (on an AVX2 CPU oneDNN's column tiles round differently at another n).
f_inv = lambda a, b, s, o: mj.ragged_dot(a, b, s, group_offset=o, batch_invariant=True)
lhs32 = jnp.asarray(rng.standard_normal((14, 160)), jnp.float32)
rhs32 = jnp.asarray(rng.standard_normal((2, 160, 136)), jnp.float32)
sizes_inv = jnp.asarray([1, 0, 7, 4, 2], jnp.int32)  # group 2 split 6 | 1 over the row shards
for offset in (0, 2):
    args = (lhs32, rhs32, sizes_inv, jnp.int32(offset))
    dp = (S("dp"), S(), S(), S())
    np.testing.assert_array_equal(jax.jit(f_inv, in_shardings=dp)(*args), f_inv(*args))
    d_lhs = lambda a: jax.grad(lambda a: jnp.sum(f_inv(a, rhs32, sizes_inv, offset) ** 2))(a)
    np.testing.assert_array_equal(jax.jit(d_lhs, in_shardings=S("dp"))(lhs32), d_lhs(lhs32))
try:
    jax.jit(f, in_shardings=dp_tp)(lhs, rhs, jnp.asarray([3, 0, 6, 2, 9], jnp.int32),
                                   0).block_until_ready()
    raise AssertionError("a total of 20 groups' rows over 14 was accepted")
except jax.errors.JaxRuntimeError as e:
    assert "sum(group_sizes) = 20" in str(e), e
print("ok")
''')


def test_sharded_jit_keeps_n_k_weights_sharded():
    """The [G, n, K] layout under jit with shardings on a 2 x 2 mesh: n over tp (the weights'
    dimension 1), rows over dp, both, or K over tp (their dimension 2). The forward and both
    gradients equal jax.lax.ragged_dot_general's, and the compiled programs gather neither the
    weights nor the rows."""
    _in_fresh_process(4, _MESH_2X2 + '''
rhs = jnp.asarray(rng.standard_normal((4, 8, 6)), jnp.float32)  # [G, n, K]
ct = jnp.asarray(rng.standard_normal((12, 8)), jnp.float32)
dn = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                       lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
cases = {"n over tp": (S(), S(None, "tp")),
         "rows over dp": (S("dp"), S()),
         "rows over dp, n over tp": (S("dp"), S(None, "tp")),
         "K over tp": (S(None, "tp"), S(None, None, "tp"))}
for name, shardings in cases.items():
    results = []
    for impl in (jax.lax.ragged_dot_general, mj.ragged_dot_general):
        f = jax.jit(lambda a, b: impl(a, b, sizes, dn), in_shardings=shardings)
        loss = lambda a, b: jnp.sum(impl(a, b, sizes, dn) * ct)
        g = jax.jit(jax.grad(loss, (0, 1)), in_shardings=shardings)
        results.append((f(lhs, rhs), *g(lhs, rhs)))
    for got, ref in zip(results[1], results[0]):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5, err_msg=name)
    for compiled in (f.lower(lhs, rhs).compile(), g.lower(lhs, rhs).compile()):
        gathers = [line for line in compiled.as_text().splitlines() if " all-gather(" in line]
        assert not gathers, (name, gathers)
print("ok")
''')


def test_large_blocks_stay_in_the_heap_unless_told_otherwise():
    """moekit.jax raises glibc's mmap threshold at import (fresh XLA buffers then reuse the
    heap), not where the program set it or opted out."""
    code = "import moekit.jax._ffi as f; print(f.KEPT_LARGE_BLOCKS)"
    variables = ("MOEKIT_KEEP_MALLOC", "MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX",
                 "MALLOC_TRIM_THRESHOLD_")
    for env, want in (({}, "True"), ({"MOEKIT_KEEP_MALLOC": "0"}, "False"),
                      ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "False"),
                      ({"MALLOC_ARENA_MAX": "4"}, "False"),
                      ({"MALLOC_TRIM_THRESHOLD_": "131072"}, "False")):
        clean = {k: v for k, v in os.environ.items() if k not in variables}
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**clean, **env}, timeout=120)
        assert run.stdout.strip() == want, (env, run.stdout, run.stderr)


def test_importing_after_the_cpu_backend_started_warns():
    """XLA's threads started before the import keep their own arenas (every large result then
    mapped afresh): moekit.jax says so, and says nothing when imported first."""
    late = ("import warnings, jax, jax.numpy as jnp; jnp.ones(1).block_until_ready(); "
            "warnings.simplefilter('error'); import moekit.jax")
    first = ("import warnings; warnings.simplefilter('error'); import jax, moekit.jax; "
             "import jax.numpy as jnp; jnp.ones(1).block_until_ready(); print('ok')")
    env = {k: v for k, v in os.environ.items()
           if k not in ("MOEKIT_KEEP_MALLOC", "MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX",
                        "MALLOC_TRIM_THRESHOLD_")}
    run = subprocess.run([sys.executable, "-c", late], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode != 0 and "imported after JAX started its backend" in run.stderr, (
        run.stdout, run.stderr)
    run = subprocess.run([sys.executable, "-c", first], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.stdout, run.stderr)


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_batch_invariant_rows_and_gradients_are_the_same_bits(dtype, layout):
    """batch_invariant=True: a probe row's output and input gradient are the same bits in a
    group of 1 to 600 rows, among other groups, with an offset; a group's weight gradient is the
    same bits for the same rows among other groups. Weights [E, K, n], and [E, n, K] read as they
    lie (ragged_dot_general)."""
    K, n, G, e_loc = 160, 136, 5, 3
    rng = np.random.default_rng(3)
    rhs = jnp.asarray(rng.standard_normal((e_loc, K, n) if layout == "kn" else (e_loc, n, K)),
                      dtype)
    probe = jnp.asarray(rng.standard_normal(K), dtype)
    g_probe = jnp.asarray(rng.standard_normal(n), dtype)

    @jax.jit
    def run(lhs, g, sizes, offset):
        def loss(lhs, rhs):
            kwargs = dict(group_offset=offset, batch_invariant=True, preferred_element_type=F32)
            if layout == "kn":
                out = mj.ragged_dot(lhs, rhs, sizes, **kwargs)
            else:
                out = mj.ragged_dot_general(lhs, rhs, sizes, RHS_LAYOUT_DN["gnk"], **kwargs)
            return jnp.sum(out * g.astype(F32)), out
        (_, out), (d_lhs, d_rhs) = jax.value_and_grad(loss, (0, 1), has_aux=True)(lhs, rhs)
        return out, d_lhs, d_rhs

    want = None
    for size, at, offset in ((1, 0, 0), (7, 6, 2), (17, 0, 1), (300, 150, 0), (600, 599, 2)):
        sizes = rng.integers(0, 40, G).astype(np.int32)
        sizes[offset + 1] = size
        start = int(sizes[:offset + 1].sum())
        m = int(sizes.sum()) + 3
        lhs = jnp.asarray(rng.standard_normal((m, K)), dtype).at[start + at].set(probe)
        g = jnp.asarray(rng.standard_normal((m, n)), dtype).at[start + at].set(g_probe)
        out, d_lhs, _ = run(lhs, g, jnp.asarray(sizes), jnp.int32(offset))
        got = (np.asarray(out[start + at]).view(np.uint8),
               np.asarray(d_lhs[start + at]).view(np.uint8))
        if want is None:
            want = got
        assert np.array_equal(got[0], want[0]), f"out differs in a group of {size} at {at}"
        assert np.array_equal(got[1], want[1]), f"d_lhs differs in a group of {size} at {at}"
    # The weight gradient of one group's 300 rows, among different other groups and offsets.
    rows = jnp.asarray(rng.standard_normal((300, K)), dtype)
    g_rows = jnp.asarray(rng.standard_normal((300, n)), dtype)
    want = None
    for offset in (0, 2, 1):
        sizes = rng.integers(0, 200, G).astype(np.int32)
        sizes[offset + 1] = 300
        start = int(sizes[:offset + 1].sum())
        m = int(sizes.sum())
        lhs = jnp.asarray(rng.standard_normal((m, K)), dtype).at[start:start + 300].set(rows)
        g = jnp.asarray(rng.standard_normal((m, n)), dtype).at[start:start + 300].set(g_rows)
        d_rhs = np.asarray(run(lhs, g, jnp.asarray(sizes), jnp.int32(offset))[2][1]).view(np.uint8)
        if want is None:
            want = d_rhs
        assert np.array_equal(d_rhs, want), f"group 1's weight gradient differs at {offset}"
