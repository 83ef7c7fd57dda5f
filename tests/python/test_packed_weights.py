"""moekit.jax.pack_ragged_rhs, and ragged_dot and moe_layer on packed weights (the CPU's
inference forward): the layout against its documented index, ragged_dot against the masked
reference and the same weights unpacked (group_offset, jit, vmap), moe_layer against itself on
the weights unpacked, and the errors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moekit.jax as mj
from jax.sharding import PartitionSpec as P
from test_ragged_dot import CASES, masked_reference

F32, BF16 = jnp.float32, jnp.bfloat16


def _bf16(rng, shape, dtype=BF16):
    # Sixty-fourths in [-1, 1]: exact in bfloat16, their products exact in float32.
    return jnp.asarray(rng.integers(-64, 65, shape) / 64.0, dtype)


DTYPES = pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])


@pytest.mark.parametrize("K,n", [(1, 1), (2, 32), (5, 33), (64, 48), (33, 17), (0, 8), (4, 0)])
@pytest.mark.parametrize("transposed", [False, True], ids=["EKn", "EnK"])
@DTYPES
def test_layout_is_the_documented_index(K, n, transposed, dtype):
    w = _bf16(np.random.default_rng(K * 100 + n), (3, K, n), dtype)
    packed = mj.pack_ragged_rhs(jnp.swapaxes(w, 1, 2) if transposed else w,
                                rhs_transposed=transposed)
    panels = -(-n // 32)
    elems = 64 * -(-K // 2) if dtype == BF16 else 32 * K
    assert packed.data.shape == (3, panels, elems) and packed.data.dtype == dtype
    assert packed.dtype == dtype and packed.shape == (3, K, n)
    assert (packed.k, packed.n, packed.num_local) == (K, n, 3)
    want = np.zeros((3, panels, elems), np.float32)
    for j in range(3):
        for k in range(K):
            for c in range(n):
                at = (64 * (k // 2) + 2 * (c % 32) + k % 2 if dtype == BF16
                      else 32 * k + c % 32)
                want[j, c // 32, at] = float(w[j, k, c])
    np.testing.assert_array_equal(np.asarray(packed.data, np.float32), want)  # padding 0


@pytest.mark.parametrize("transposed", [False, True], ids=["EKn", "EnK"])
@pytest.mark.parametrize("m,K,n,sizes", CASES + [(40, 7, 70, [13, 0, 27]), (0, 5, 33, [0, 0])])
@DTYPES
def test_forward_equals_the_masked_reference_and_the_unpacked_weights(m, K, n, sizes, transposed,
                                                                     dtype):
    rng = np.random.default_rng(m + K + n)
    num_groups = len(sizes)
    lhs, gs = _bf16(rng, (m, K), dtype), jnp.asarray(sizes, jnp.int32)
    for num_local in sorted({1, max(1, num_groups // 2), num_groups}):
        w = _bf16(rng, (num_local, K, n), dtype)
        packed = mj.pack_ragged_rhs(jnp.swapaxes(w, 1, 2) if transposed else w,
                                    rhs_transposed=transposed)
        for offset in range(num_groups - num_local + 1):
            got = mj.ragged_dot(lhs, packed, gs, group_offset=offset,
                                preferred_element_type=F32)
            want = masked_reference(lhs.astype(F32), w.astype(F32), gs, offset)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * K)
            unpacked = mj.ragged_dot(lhs, w, gs, group_offset=offset)
            got_own = mj.ragged_dot(lhs, packed, gs, group_offset=offset)
            assert got_own.dtype == dtype and got_own.shape == (m, n)
            tol = 1e-2 if dtype == BF16 else 1e-6
            np.testing.assert_allclose(np.asarray(got_own, np.float32),
                                       np.asarray(unpacked, np.float32), rtol=tol, atol=tol)


def test_packed_weights_pass_through_jit_and_vmap():
    rng = np.random.default_rng(3)
    w, gs = _bf16(rng, (2, 33, 40)), jnp.asarray([5, 0, 9, 3], jnp.int32)
    packed = jax.jit(mj.pack_ragged_rhs)(w)
    assert isinstance(packed, mj.PackedRhs) and (packed.k, packed.n) == (33, 40)
    lhs = _bf16(rng, (4, 17, 33))  # a batch of 4
    f = jax.jit(lambda a, p, o: mj.ragged_dot(a, p, gs, group_offset=o,
                                              preferred_element_type=F32))
    for b in range(4):
        np.testing.assert_allclose(f(lhs[b], packed, 2),
                                   masked_reference(lhs[b].astype(F32), w.astype(F32), gs, 2),
                                   rtol=1e-6, atol=1e-5)
    batched = jax.vmap(lambda a: mj.ragged_dot(a, packed, gs, group_offset=1,
                                               preferred_element_type=F32))(lhs)
    for b in range(4):
        np.testing.assert_allclose(batched[b],
                                   masked_reference(lhs[b].astype(F32), w.astype(F32), gs, 1),
                                   rtol=1e-6, atol=1e-5)


def test_errors_name_the_argument():
    rng = np.random.default_rng(4)
    w, gs = _bf16(rng, (2, 8, 16)), jnp.asarray([3, 4], jnp.int32)
    packed = mj.pack_ragged_rhs(w)
    with pytest.raises(TypeError, match="pack_ragged_rhs: rhs dtype float16 is neither bfloat16 "
                                        "nor float32"):
        mj.pack_ragged_rhs(w.astype(jnp.float16))
    with pytest.raises(ValueError, match="pack_ragged_rhs: rhs"):
        mj.pack_ragged_rhs(w[0])
    with pytest.raises(TypeError, match="ragged_dot: lhs dtype float32 is not the packed "
                                        "weights' .PackedRhs. bfloat16"):
        mj.ragged_dot(jnp.zeros((7, 8), F32), packed, gs)
    with pytest.raises(TypeError, match="ragged_dot: lhs dtype bfloat16 is not the packed "
                                        "weights' .PackedRhs. float32"):
        mj.ragged_dot(jnp.zeros((7, 8), BF16), mj.pack_ragged_rhs(w.astype(F32)), gs)
    with pytest.raises(ValueError, match=r"lhs.shape\[1\] = 9 differs from the packed weights' K = 8"):
        mj.ragged_dot(jnp.zeros((7, 9), BF16), packed, gs)
    with pytest.raises(ValueError, match="group_sizes has 3 groups but rhs holds 2"):
        mj.ragged_dot(jnp.zeros((7, 8), BF16), packed, jnp.asarray([1, 2, 3], jnp.int32))
    with pytest.raises(TypeError, match="ragged_dot_general: packed weights .PackedRhs. go to"):
        dn = jax.lax.RaggedDotDimensionNumbers((([1], [1]), ([], [])), [0], [0])
        mj.ragged_dot_general(jnp.zeros((7, 8), BF16), packed, gs, dn)
    with pytest.raises(TypeError, match="packed weights .PackedRhs. serve the forward only"):
        jax.grad(lambda a: jnp.sum(mj.ragged_dot(a, packed, gs).astype(F32)))(
            jnp.ones((7, 8), BF16))
    with pytest.raises(Exception, match="group_sizes"):  # the C++ library's, at run time
        mj.ragged_dot(jnp.zeros((7, 8), BF16), packed, jnp.asarray([-1, 4], jnp.int32)) \
            .block_until_ready()


@pytest.mark.parametrize("transposed", [False, True], ids=["EKn", "EnK"])
@pytest.mark.parametrize("m,K,n,sizes", [(40, 7, 70, [13, 0, 27]), (9, 33, 40, [5, 0, 4]),
                                         (0, 5, 33, [0, 0])])
@DTYPES
def test_input_gradient_through_the_transposes_packed(m, K, n, sizes, transposed, dtype):
    # pack_ragged_rhs(..., input_gradient=True): lhs's gradient (grad, jvp, linear_transpose,
    # under jit and vmap) equals the one through the weights unpacked, on every offset; the
    # transposes' layout is the documented one of the weights' transposes.
    rng = np.random.default_rng(m + 7 * K + n)
    num_groups = len(sizes)
    lhs, gs = _bf16(rng, (m, K), dtype), jnp.asarray(sizes, jnp.int32)
    for num_local in sorted({1, num_groups}):
        w = _bf16(rng, (num_local, K, n), dtype)
        packed = mj.pack_ragged_rhs(jnp.swapaxes(w, 1, 2) if transposed else w,
                                    rhs_transposed=transposed, input_gradient=True)
        np.testing.assert_array_equal(packed.data_t,
                                      mj.pack_ragged_rhs(jnp.swapaxes(w, 1, 2)).data)
        assert "input_gradient" in repr(packed)
        ct = _bf16(rng, (m, n), F32)
        for offset in range(num_groups - num_local + 1):
            def loss(a, rhs):
                out = mj.ragged_dot(a, rhs, gs, group_offset=offset, preferred_element_type=F32)
                return jnp.sum(out * ct)
            got = jax.jit(jax.grad(loss))(lhs, packed)
            want = jax.grad(loss)(lhs, w)
            assert got.dtype == dtype and got.shape == (m, K)
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                       rtol=1e-6, atol=1e-6 * n)
            f = lambda a: mj.ragged_dot(a, packed, gs, group_offset=offset,
                                        preferred_element_type=F32)
            _, tangent = jax.jvp(f, (lhs,), (lhs,))
            np.testing.assert_allclose(tangent, f(lhs), rtol=1e-6, atol=1e-6)  # linear in lhs
            (back,) = jax.linear_transpose(f, lhs)(ct)
            np.testing.assert_allclose(np.asarray(back, np.float32), np.asarray(want, np.float32),
                                       rtol=1e-6, atol=1e-6 * n)
    if m:  # a batch of 2 under vmap, each its own call
        batch = jnp.stack([lhs, lhs[::-1]])
        grads = jax.vmap(jax.grad(lambda a: jnp.sum(mj.ragged_dot(a, packed, gs).astype(F32))))(
            batch)
        for b in range(2):
            want = jax.grad(lambda a: jnp.sum(mj.ragged_dot(a, w, gs).astype(F32)))(batch[b])
            np.testing.assert_allclose(np.asarray(grads[b], np.float32),
                                       np.asarray(want, np.float32), rtol=1e-6, atol=1e-5)


def test_input_gradient_refuses_the_weights_gradient():
    rng = np.random.default_rng(6)
    w, gs = _bf16(rng, (2, 8, 16)), jnp.asarray([3, 4], jnp.int32)
    packed = mj.pack_ragged_rhs(w, input_gradient=True)
    lhs = jnp.ones((7, 8), BF16)
    loss = lambda a, p: jnp.sum(mj.ragged_dot(a, p, gs).astype(F32))
    with pytest.raises(TypeError, match="packed weights .PackedRhs. take no gradient"):
        jax.grad(loss, argnums=1)(lhs, packed)
    with pytest.raises(TypeError, match="packed weights .PackedRhs. take no gradient"):
        jax.jvp(lambda d: loss(lhs, mj.PackedRhs(d, 8, 16, packed.data_t)), (packed.data,),
                (packed.data,))
    with pytest.raises(TypeError, match="for lhs's gradient pack them with input_gradient=True"):
        jax.grad(loss)(lhs, mj.pack_ragged_rhs(w))
    # Forward mode needs no transposes: jvp reaches lhs on the forward's packing alone.
    f = lambda a: mj.ragged_dot(a, mj.pack_ragged_rhs(w), gs, preferred_element_type=F32)
    np.testing.assert_array_equal(jax.jvp(f, (lhs,), (2 * lhs,))[1], 2 * f(lhs))
    # A PackedRhs put together by hand whose transposes do not match: refused before any call.
    bad = mj.PackedRhs(packed.data, 8, 16, packed.data)  # the transposes' are [2, 1, 512]
    with pytest.raises(ValueError, match=r"PackedRhs.data_t is \(2, 1, 256\) bfloat16; K = 8, "
                                         r"n = 16 pack into \(2, 1, 512\)"):
        mj.ragged_dot(lhs, bad, gs)
    with pytest.raises(ValueError, match=r"PackedRhs.data is \(2, 1, 64\)"):
        mj.ragged_dot(lhs, mj.PackedRhs(packed.data[:, :, :64], 8, 16), gs)


def _layer_params(rng, H, F, E, shared, dtype=BF16):
    w = lambda *shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-2]), dtype)
    return mj.MoeParams(w(H, E), w(E, H, 2 * F), w(E, F, H),
                        w(H, 2 * 5) if shared else None, w(5, H) if shared else None)


@pytest.mark.parametrize("transposed", [False, True], ids=["in_out", "out_in"])
@pytest.mark.parametrize("T,shared", [(1, False), (13, True), (64, False)])
@DTYPES
def test_moe_layer_on_packed_weights_equals_the_unpacked_layer(T, shared, transposed, dtype):
    rng = np.random.default_rng(T)
    H, F, E, k = 48, 40, 6, 2
    p = _layer_params(rng, H, F, E, shared, dtype)
    x = jnp.asarray(rng.standard_normal((T, H)), dtype)
    if transposed:  # checkpoints' [E, out, in]
        p = p._replace(w_in=jnp.swapaxes(p.w_in, 1, 2), w_out=jnp.swapaxes(p.w_out, 1, 2))
    packed = p._replace(w_in=mj.pack_ragged_rhs(p.w_in, rhs_transposed=transposed),
                        w_out=mj.pack_ragged_rhs(p.w_out, rhs_transposed=transposed))
    options = dict(k=k, aux_loss_coeff=0.01, z_loss_coeff=0.001)
    got, got_aux = jax.jit(lambda x, p: mj.moe_layer(x, p, **options))(x, packed)
    want, want_aux = mj.moe_layer(x, p, expert_weights_transposed=transposed, fused=True,
                                  **options)
    assert got.shape == (T, H) and got.dtype == dtype
    tol = 2e-2 if dtype == BF16 else 1e-5
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol)
    np.testing.assert_array_equal(got_aux.tokens_per_expert, want_aux.tokens_per_expert)
    np.testing.assert_allclose(got_aux.aux_loss, want_aux.aux_loss, rtol=1e-6)
    np.testing.assert_allclose(got_aux.z_loss, want_aux.z_loss, rtol=1e-6)


def test_moe_layer_on_packed_weights_refuses_by_name():
    rng = np.random.default_rng(5)
    p = _layer_params(rng, 16, 8, 4, False)
    x = jnp.asarray(rng.standard_normal((5, 16)), BF16)
    packed = p._replace(w_in=mj.pack_ragged_rhs(p.w_in), w_out=mj.pack_ragged_rhs(p.w_out))
    with pytest.raises(ValueError, match="pack both .pack_ragged_rhs. or neither"):
        mj.moe_layer(x, p._replace(w_in=packed.w_in), k=2)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "ep"))
    spec = mj.MoeParams(P(), P(), P())
    with pytest.raises(ValueError, match="run on the CPU, on one device or each device its "
                                         "experts' .ep_axis.; not with token_axes"):
        jax.shard_map(lambda x, p: mj.moe_layer(x, p, k=2, token_axes="data")[0], mesh=mesh,
                      in_specs=(P("data"), spec), out_specs=P("data"))(x, packed)
    with pytest.raises(ValueError, match="not with expert_weights_transposed"):
        mj.moe_layer(x, packed, k=2, expert_weights_transposed=True)
    with pytest.raises(ValueError, match=r"params.w_in must be \[4, 16, 16\]"):
        mj.moe_layer(x, packed._replace(w_in=mj.pack_ragged_rhs(p.w_in[:, :, :8])), k=2)
    with pytest.raises(TypeError, match="params.w_in is bfloat16, x is float32"):
        mj.moe_layer(x.astype(F32), packed._replace(router=p.router.astype(F32)), k=2)
    frozen = p._replace(w_in=mj.pack_ragged_rhs(p.w_in, input_gradient=True),
                        w_out=mj.pack_ragged_rhs(p.w_out, input_gradient=True))
    for fused in (None, False):  # the fused forward takes the steps under differentiation
        with pytest.raises(TypeError, match="for lhs's gradient pack them with "
                                            "input_gradient=True"):
            jax.grad(lambda x: jnp.sum(mj.moe_layer(x, packed, k=2, fused=fused)[0]
                                       .astype(F32)))(x)
        with pytest.raises(TypeError, match="packed weights .PackedRhs. take no gradient"):
            jax.grad(lambda q: jnp.sum(mj.moe_layer(x, q, k=2, fused=fused)[0]
                                       .astype(F32)))(frozen)


@pytest.mark.parametrize("T", [1, 13])
@DTYPES
def test_moe_layer_steps_and_ep_on_packed_weights(T, dtype):
    # fused=False and ep_axis (under shard_map; one device here, the exchange on one rank) run
    # the steps with ragged_dot on the packed weights: the same forward as the fused layer on
    # them and as the steps on the weights unpacked.
    rng = np.random.default_rng(20 + T)
    H, F, E, k = 48, 40, 6, 2
    p = _layer_params(rng, H, F, E, True, dtype)
    x = jnp.asarray(rng.standard_normal((T, H)), dtype)
    packed = p._replace(w_in=mj.pack_ragged_rhs(p.w_in), w_out=mj.pack_ragged_rhs(p.w_out))
    options = dict(k=k, aux_loss_coeff=0.01)
    fused, fused_aux = mj.moe_layer(x, packed, **options)
    steps, steps_aux = jax.jit(lambda x, q: mj.moe_layer(x, q, fused=False, **options))(x, packed)
    unpacked, _ = mj.moe_layer(x, p, fused=False, **options)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("ep",))
    spec = mj.MoeParams(P(), P("ep"), P("ep"), P(), P())
    ep = jax.jit(jax.shard_map(lambda x, q: mj.moe_layer(x, q, ep_axis="ep", **options)[0],
                               mesh=mesh, in_specs=(P("ep"), spec), out_specs=P("ep")))(x, packed)
    tol = 2e-2 if dtype == BF16 else 1e-5
    for got in (steps, ep, unpacked):
        assert got.shape == (T, H) and got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(fused, np.float32),
                                   rtol=tol, atol=tol)
    np.testing.assert_array_equal(steps_aux.tokens_per_expert, fused_aux.tokens_per_expert)
    np.testing.assert_allclose(steps_aux.aux_loss, fused_aux.aux_loss, rtol=1e-5)


@pytest.mark.parametrize("T,skew", [(11, False), (0, False), (11, True)],
                         ids=["11_tokens", "no_tokens", "every_token_to_expert_0"])
@pytest.mark.parametrize("fused", [None, False], ids=["default", "steps"])
@DTYPES
def test_moe_layer_gradients_through_frozen_packed_experts(dtype, fused, T, skew):
    # input_gradient=True packs: x's, the router's and the shared expert's gradients equal those
    # through the same weights unpacked, step by step (fused=False), or by default, where the
    # fused forward on them takes the steps under differentiation; the experts' weights closed
    # over. Also with no tokens, and with an expert bias sending every token to expert 0 (one
    # group holding every token's first row, the others empty or nearly).
    rng = np.random.default_rng(31)
    H, F, E, k = 48, 40, 6, 2
    bias = jnp.asarray([30.0] + [0.0] * (E - 1), F32) if skew else None
    p = _layer_params(rng, H, F, E, True, dtype)
    x = jnp.asarray(rng.standard_normal((T, H)), dtype)
    ct = jnp.asarray(rng.standard_normal((T, H)), dtype)
    w_in = mj.pack_ragged_rhs(p.w_in, input_gradient=True)
    w_out = mj.pack_ragged_rhs(p.w_out, input_gradient=True)

    def loss(x, router, shared_in, shared_out, w_in, w_out, fused=False):
        q = mj.MoeParams(router, w_in, w_out, shared_in, shared_out)
        out, aux = mj.moe_layer(x, q, k=k, aux_loss_coeff=0.01, fused=fused, expert_bias=bias,
                                score="sigmoid" if skew else "softmax")
        return jnp.sum(out.astype(F32) * ct.astype(F32)) + aux.aux_loss

    if skew:  # the bias does what the case says
        q = mj.MoeParams(p.router, w_in, w_out, p.shared_in, p.shared_out)
        counts = mj.moe_layer(x, q, k=k, score="sigmoid", expert_bias=bias)[1].tokens_per_expert
        assert int(counts[0]) == T
    trainable = (x, p.router, p.shared_in, p.shared_out)
    got = jax.jit(jax.grad(lambda *a: loss(*a, w_in, w_out, fused), argnums=(0, 1, 2, 3)))(
        *trainable)
    want = jax.grad(lambda *a: loss(*a, p.w_in, p.w_out), argnums=(0, 1, 2, 3))(*trainable)
    if fused is None:  # the fused forward's one call, which the steps replace under grad
        calls = lambda f: set(re.findall(r"moekit_\w+", str(jax.make_jaxpr(f)(*trainable))))
        forward = lambda *a: loss(*a, w_in, w_out, fused)
        assert calls(forward) == {"moekit_layer_fwd"}
        assert "moekit_layer_fwd" not in calls(jax.grad(forward, argnums=(0, 1, 2, 3)))
    tol = 3e-2 if dtype == BF16 else 1e-4
    for name, g, w in zip(("x", "router", "shared_in", "shared_out"), got, want):
        assert g.dtype == dtype, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=tol, atol=tol, err_msg=name)
