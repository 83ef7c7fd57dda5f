"""moekit.jax's router, losses, permutation, activation and moe_layer on an NVIDIA GPU (the CUDA
FFI handlers) against the same functions on the CPU (moekit's CPU handlers), on the same inputs:
integer outputs and routing decisions equal, float results within f32 summation order (f32) or
one bfloat16 rounding (bf16) of the CPU's, values and gradients, under jit.

Inputs are chosen so that no routing decision rests on a rounding: logits are distinct multiples
of 1/16 per row (or the layer's x and weights multiples of 1/8, whose logits are exact in f32),
with rows of exact ties and a NaN row, which both platforms resolve by the same rule.

Skipped, with the reason, where JAX sees no GPU or moekit was built without CUDA. With
MOEKIT_GPU_TEST_ON_CPU=1 the "GPU" side is the CPU too: the comparisons then check the test's
own plumbing on a machine without a GPU (they are trivially close there).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moekit.jax as mj

F32, BF16 = jnp.float32, jnp.bfloat16
CPU = jax.devices("cpu")[0]
ON_CPU = os.environ.get("MOEKIT_GPU_TEST_ON_CPU") == "1"


def _gpu():
    if ON_CPU:
        return CPU
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        return None


GPU = _gpu()
pytestmark = [
    pytest.mark.skipif(GPU is None, reason="no GPU visible to JAX (jax.devices('gpu') is empty)"),
    pytest.mark.skipif(not (ON_CPU or mj.cuda_built()),
                       reason="moekit was built without its CUDA backend"),
]


def _both(fn, *args):
    """fn jitted on the GPU and on the CPU, each on its own copy of the arguments."""
    out = []
    for device in (GPU, CPU):
        placed = jax.device_put(args, device)
        out.append(jax.jit(fn)(*placed))
    return out


def _tol(dtype):
    return 2e-5 if dtype == F32 else 2e-2


def _close(got, want, dtype, what):
    """Each leaf: the same shape and dtype; integers and bools equal; floats within tol of the
    CPU's, relative to the largest |value| of the leaf."""
    got_l, want_l = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_l) == len(want_l), what
    for i, (g, w) in enumerate(zip(got_l, want_l)):
        assert g.shape == w.shape and g.dtype == w.dtype, (what, i, g.shape, w.shape)
        g, w = np.asarray(g), np.asarray(w)
        if not np.issubdtype(w.dtype, np.floating) and w.dtype != np.dtype(BF16):
            np.testing.assert_array_equal(g, w, err_msg=f"{what}[{i}]")
            continue
        g, w = g.astype(np.float64), w.astype(np.float64)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"{what}[{i}] NaNs")
        finite = ~np.isnan(w)
        scale = max(np.abs(w[finite]).max(initial=0.0), 1e-30)
        err = np.abs(g[finite] - w[finite]).max(initial=0.0)
        assert err <= _tol(dtype) * scale, f"{what}[{i}]: max error {err}, scale {scale}"


def _grid_logits(T, E, dtype, seed, ties=True):
    """Per row a permutation of distinct multiples of 1/16 (exact in bf16); then a row of equal
    logits and a row with a NaN, whose choices follow the tie and NaN rules."""
    rng = np.random.default_rng(seed)
    x = np.stack([rng.permutation(E) for _ in range(T)]).astype(np.float32)
    x = (x - E / 2) / 16
    if ties and T >= 3:
        x[1] = 0.25
        x[2, E // 3] = np.nan
    return jnp.asarray(x, dtype)


ROUTES = {
    "softmax_post": dict(),
    "softmax_pre": dict(pre_softmax=True),
    "sigmoid_groups_bias": dict(score="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5,
                                bias=True),
    "sqrtsoftplus": dict(score="sqrtsoftplus"),
}


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(ROUTES))
def test_route_and_its_gradient(name, dtype):
    T, E, k = 37, 32, 4
    opts = dict(ROUTES[name])
    # A bias 4 apart per expert (shuffled): it decides, by margins no rounding reaches.
    bias = (jnp.asarray(np.random.default_rng(5).permutation(E) * 4.0, F32)
            if opts.pop("bias", False) else None)
    logits = _grid_logits(T, E, dtype, seed=1)
    c_probs = jnp.asarray(np.random.default_rng(2).normal(size=(T, E)), F32)
    c_w = jnp.asarray(np.random.default_rng(3).normal(size=(T, k)), F32)

    def f(x, b):
        r = mj.route(x, k, expert_bias=b, **opts)
        loss = lambda x: jnp.sum(jnp.nan_to_num(
            mj.route(x, k, expert_bias=b, **opts).probs.astype(F32)) * c_probs) + jnp.sum(
                jnp.nan_to_num(mj.route(x, k, expert_bias=b, **opts).topk_weights.astype(F32))
                * c_w)
        return r, jax.grad(loss)(x)

    got, want = _both(f, logits, bias)
    _close(got, want, dtype, name)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("score", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_losses_and_their_gradients(score, dtype):
    T, E, k, B = 36, 16, 3, 4
    # With a row of ties and a row holding a NaN: the losses that sum the NaN row are NaN, and
    # its gradient row too, on both platforms (router.h's NaN rule: a blow-up must show).
    logits = _grid_logits(T, E, dtype, seed=7)

    def f(x):
        def losses(x):
            scores, amap = mj.aux_loss_scores(x, k, score=score)
            counts = jnp.sum(amap, axis=0, dtype=jnp.int32)
            per_seq = jnp.sum(amap.reshape(B, T // B, E), axis=1, dtype=jnp.int32)
            return (mj.load_balancing_loss(scores, counts, k=k, coeff=0.01, total_tokens=2 * T),
                    mj.load_balancing_loss(scores, per_seq, k=k, coeff=0.02),
                    mj.z_loss(x, 1e-3))
        # Cotangents other than 1, so that the CUDA backward's scaling shows.
        total = lambda x: jnp.dot(jnp.stack(losses(x)), jnp.asarray([0.7, 1.3, 2.1], F32))
        return losses(x), jax.grad(total)(x), mj.aux_loss_scores(x, k, score=score)

    got, want = _both(f, logits)
    _close(got, want, dtype, score)


PERMUTES = {
    "indices": dict(),
    "indices_probs_align": dict(probs=True, align_size=8),
    "capacity_probs": dict(probs=True, capacity_factor=0.6),
    "capacity_position_padded": dict(probs=True, capacity_factor=0.8, drop_policy="position",
                                     pad_to_capacity=True),
    "routing_map": dict(routing_map=True, probs=True),
    "all_to_one_expert": dict(one_expert=True, probs=True),
}


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(PERMUTES))
def test_permute_unpermute_and_their_gradients(name, dtype):
    T, E, k, H = 53, 12, 3, 40
    o = dict(PERMUTES[name])
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.integers(-8, 9, (T, H)) / 8, dtype)
    idx = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    if o.pop("one_expert", False):
        idx[:, 0] = E - 1
        idx[:, 1:] = np.arange(k - 1)
    # Probs with exact ties between tokens (the probs policy orders them by position).
    probs = jnp.asarray(rng.integers(1, 9, (T, k)) / 8, dtype) if o.pop("probs", False) else None
    use_map = o.pop("routing_map", False)
    if use_map:
        routing = np.zeros((T, E), bool)
        np.put_along_axis(routing, idx, True, axis=1)
        routing = jnp.asarray(routing)
        if probs is not None:
            dense = np.zeros((T, E), np.float32)
            np.put_along_axis(dense, idx, np.asarray(probs, np.float32), axis=1)
            probs = jnp.asarray(dense, dtype)
        kwargs = dict(k=k, **o)
    else:
        routing = jnp.asarray(idx)
        kwargs = dict(num_experts=E, **o)
    S = routing.shape[1]
    c_y = jnp.asarray(rng.normal(size=(T, H)), F32)

    def f(x, routing, probs):
        def run(x, probs):
            p = mj.permute(x, routing, probs, **kwargs)
            y = p.x * 1.5  # the experts
            w = probs if probs is not None else None
            return p, mj.unpermute(y, p, w)
        p, out = run(x, probs)
        loss = lambda x, probs: jnp.sum(run(x, probs)[1].astype(F32) * c_y) + (
            0.0 if probs is None else jnp.sum(run(x, probs)[0].probs.astype(F32)))
        grads = jax.grad(loss, (0, 1) if probs is not None else 0)(x, probs)
        return p, out, grads

    got, want = _both(f, x, routing, probs)
    _close(got, want, dtype, name)
    assert got[0].row_map.shape == (2, T, S)


def test_counts_and_the_bias_update():
    """count_tokens_per_expert (whole batch and per sequence) and update_expert_bias, integers and
    the bias (rate * a sign, exact) equal."""
    rng = np.random.default_rng(17)
    m = jnp.asarray(rng.random((48, 12)) < 0.3)
    bias = jnp.asarray(rng.integers(-8, 9, 12) / 8, F32)

    def f(m, bias):
        counts = mj.count_tokens_per_expert(m)
        return counts, mj.count_tokens_per_expert(m, 4), mj.update_expert_bias(bias, counts, 0.25)

    got, want = _both(f, m, bias)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_sort_chunks_by_index(dtype):
    rng = np.random.default_rng(13)
    sizes = jnp.asarray([5, 0, 17, 3, 0, 9], jnp.int32)
    order = jnp.asarray(rng.permutation(6), jnp.int32)
    x = jnp.asarray(rng.integers(-8, 9, (40, 24)) / 8, dtype)  # rows past the chunks too
    probs = jnp.asarray(rng.integers(-8, 9, 40) / 8, dtype)
    c = jnp.asarray(rng.normal(size=(40, 24)), F32)

    def f(x, probs):
        out = mj.sort_chunks_by_index(x, sizes, order, probs)
        back = mj.sort_chunks_by_index(out[0], sizes, order, inverse=True)
        g = jax.grad(lambda x: jnp.sum(
            mj.sort_chunks_by_index(x, sizes, order).astype(F32) * c))(x)
        return out, back, g

    got, want = _both(f, x, probs)
    _close(got, want, dtype, "sort_chunks_by_index")
    np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(x, np.float32))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kind", ["swiglu", "geglu", "gelu", "relu"])
def test_activation_and_its_gradient(kind, dtype):
    N, F = 29, 24
    width = 2 * F if kind in ("swiglu", "geglu") else F
    rng = np.random.default_rng(17)
    h = jnp.asarray(rng.normal(size=(N, width)), dtype)
    c = jnp.asarray(rng.normal(size=(N, F)), F32)

    def f(h):
        out = []
        for rows in (None, 0, 11, N):  # every row; or the first rows, 0 after
            act = lambda h: mj.activation(h, kind, rows=rows)
            out.append((act(h), jax.grad(lambda h: jnp.sum(act(h).astype(F32) * c))(h)))
        return out

    got, want = _both(f, h)
    _close(got, want, dtype, kind)
    a, g = got[2]
    assert not np.asarray(a, np.float32)[11:].any() and not np.asarray(g, np.float32)[11:].any()


def _layer_inputs(T, H, F, E, dtype, gated, shared, seed):
    rng = np.random.default_rng(seed)
    exact = lambda *shape: jnp.asarray(rng.integers(-8, 9, shape) / 8, dtype)
    W = 2 * F if gated else F
    params = mj.MoeParams(exact(H, E) / 4, exact(E, H, W) / 4, exact(E, F, H) / 4,
                          exact(H, 2 * F if gated else F) / 4 if shared else None,
                          exact(F, H) / 4 if shared else None)
    return exact(T, H), params, jnp.asarray(rng.normal(size=(T, H)), F32)


LAYERS = {
    "qwen_like": dict(k=4),
    "deepseek_like": dict(k=4, score="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5,
                          expert_bias=True, shared=True, activation_kind="geglu"),
    "capacity_align": dict(k=2, capacity_factor=0.75, drop_policy="position", align_size=8,
                           activation_kind="relu"),
    "presoftmax_gelu": dict(k=3, pre_softmax=True, activation_kind="gelu", shared=True),
    # The experts' weights [E, out, in], read as they lie by the CUDA kernels too.
    "expert_weights_transposed": dict(k=4, expert_weights_transposed=True),
}


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("T", [1, 57])
def test_moe_layer_forward_and_gradients(name, T, dtype):
    H, F, E = 64, 32, 16
    o = dict(LAYERS[name])
    shared = o.pop("shared", False)
    gated = o.get("activation_kind", "swiglu") in ("swiglu", "geglu")
    x, params, c = _layer_inputs(T, H, F, E, dtype, gated, shared, seed=19)
    if o.pop("expert_bias", False):
        o["expert_bias"] = jnp.asarray(np.random.default_rng(23).permutation(E) * 4.0, F32)
    if o.get("expert_weights_transposed"):
        params = params._replace(w_in=jnp.swapaxes(params.w_in, 1, 2),
                                 w_out=jnp.swapaxes(params.w_out, 1, 2))

    def f(x, params):
        def loss(x, params):
            out, aux = mj.moe_layer(x, params, aux_loss_coeff=0.01, z_loss_coeff=1e-3, **o)
            return jnp.sum(out.astype(F32) * c) + 0.5 * aux.aux_loss + 2.0 * aux.z_loss, (out, aux)
        (_, (out, aux)), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(x, params)
        return out, aux, grads

    # XLA's default float32 dot on the GPU rounds its inputs to TF32; the layer's jnp.dot
    # matmuls follow JAX's precision (moe_layer's docstring), so f32 is compared at "highest".
    with jax.default_matmul_precision("highest"):
        got, want = _both(f, x, params)
    _close(got, want, dtype, name)


def test_batch_invariant_is_refused_on_the_gpu():
    if ON_CPU:
        pytest.skip("the CPU runs the mode")
    x, params, _ = _layer_inputs(8, 64, 32, 16, BF16, True, False, seed=29)
    x, params = jax.device_put((x, params), GPU)
    with pytest.raises(Exception, match="batch-invariant mode runs on the CPU only"):
        jax.block_until_ready(mj.moe_layer(x, params, k=2, batch_invariant=True))
