"""moekit.jax.moe_layer against a pure-JAX MoE layer written here with jax.lax.top_k (through
test_router's reference router) and jax.lax.ragged_dot: values, the losses, and the gradients to
x and every weight, for each preset's routing on small shapes; capacity mode against drops
worked out here in NumPy from SPEC.md; and the named errors."""

import functools
import json
import math
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moekit.jax as mj
from moekit.jax import _ffi
from moekit.jax.layer import _layer_bwd, _layer_fwd
from test_router import ref_route

F32, BF16 = jnp.float32, jnp.bfloat16
# moe_layer's two paths: one FFI call each way (the C++ layer), and the steps' calls.
FUSED = pytest.mark.parametrize("fused", [True, False], ids=["fused", "steps"])

ACTS = {
    "swiglu": (True, jax.nn.silu),
    "geglu": (True, lambda g: jax.nn.gelu(g, approximate=True)),
    "gelu": (False, lambda h: jax.nn.gelu(h, approximate=True)),
    "relu": (False, jax.nn.relu),
}


def ref_ffn(h, kind):
    gated, fn = ACTS[kind]
    if gated:
        g, u = jnp.split(h, 2, axis=-1)
        return fn(g) * u
    return fn(h)


def ref_layer(x, params, *, k, keep=None, activation_kind="swiglu", aux_loss_coeff=0.0,
              z_loss_coeff=0.0, **routing):
    """The layer in float32 with lax.top_k and lax.ragged_dot: tokens sorted by expert (stable),
    the k copies combined with the routing weights (times keep, the capacity's mask [T, k]).
    Returns (out, aux_loss, z_loss, tokens_per_expert)."""
    x32 = x.astype(F32)
    router, w_in, w_out, shared_in, shared_out, b_in, b_out = (
        None if w is None else w.astype(F32) for w in params)
    T, E = x.shape[0], router.shape[1]
    logits = x32 @ router
    r = ref_route(logits, k, **routing)
    w = r.topk_weights if keep is None else r.topk_weights * keep
    flat = r.topk_indices.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    xs = x32[order // k]
    expert = flat[order]  # the expert of each sorted row
    h = jax.lax.ragged_dot(xs, w_in, sizes)
    if b_in is not None:
        h = h + b_in[expert]
    y = jax.lax.ragged_dot(ref_ffn(h, activation_kind), w_out, sizes)
    if b_out is not None:
        y = y + b_out[expert]
    y_tok = jnp.zeros_like(y).at[order].set(y).reshape(T, k, -1)
    out = jnp.einsum("tk,tkh->th", w, y_tok)
    if shared_in is not None:
        out = out + ref_ffn(x32 @ shared_in, activation_kind) @ shared_out
    aux = z = jnp.zeros((), F32)
    score = routing.get("score", "softmax")
    if aux_loss_coeff:
        if score == "softmax":
            s = jax.nn.softmax(logits, axis=-1)
        else:
            a = jax.nn.sigmoid(logits) if score == "sigmoid" else jnp.sqrt(jax.nn.softplus(logits))
            s = a / (a.sum(-1, keepdims=True) + 1e-20)
        _, top = jax.lax.top_k(jax.lax.stop_gradient(s), k)
        counts = jnp.zeros(E, F32).at[top.reshape(-1)].add(1.0)
        aux = E * aux_loss_coeff / (k * T * T) * jnp.sum(s.sum(0) * counts)
    if z_loss_coeff:
        z = z_loss_coeff * jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return out, aux, z, sizes


def without_fused(opts):
    return {name: v for name, v in opts.items() if name != "fused"}


def make_params(key, H, F, E, Fs=0, gated=True, dtype=F32):
    ks = jax.random.split(key, 5)
    W = 2 * F if gated else F
    n = lambda k, shape, fan: (jax.random.normal(k, shape) / np.sqrt(fan)).astype(dtype)  # noqa
    shared = (n(ks[3], (H, 2 * Fs if gated else Fs), H), n(ks[4], (Fs, H), Fs)) if Fs else (
        None, None)
    return mj.MoeParams(n(ks[0], (H, E), H), n(ks[1], (E, H, W), H), n(ks[2], (E, F, H), F),
                        *shared)


# (name, T, H, F, E, k, Fs, options): each preset's routing on small odd shapes, the other
# scores and activations, and the losses.
CASES = [
    ("mixtral", 13, 16, 9, 8, 2, 0, dict()),
    ("qwen3", 11, 12, 5, 16, 8, 0, dict(aux_loss_coeff=0.5)),
    ("deepseek_v2_lite", 9, 16, 7, 8, 3, 14, dict(pre_softmax=True, z_loss_coeff=0.1)),
    ("deepseek_v3", 12, 16, 5, 16, 4, 5,
     dict(score="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5, bias=True,
          aux_loss_coeff=1.0)),
    ("gpt_oss", 7, 9, 9, 8, 4, 0, dict()),
    ("olmoe", 10, 8, 6, 8, 8, 0, dict(pre_softmax=True)),
    ("sqrtsoftplus_geglu", 9, 10, 7, 6, 2, 3,
     dict(score="sqrtsoftplus", activation_kind="geglu", aux_loss_coeff=1.0)),
    ("sigmoid_gelu", 8, 6, 5, 4, 1, 0, dict(score="sigmoid", activation_kind="gelu")),
    ("relu", 6, 5, 4, 4, 2, 2, dict(activation_kind="relu", z_loss_coeff=0.5)),
    # The expert FFNs' biases (gpt-oss), together and each alone.
    ("gpt_oss_biases", 7, 9, 9, 8, 4, 0, dict(biases=("b_in", "b_out"), z_loss_coeff=0.2)),
    ("b_in_shared_geglu", 9, 10, 7, 6, 2, 3,
     dict(biases=("b_in",), activation_kind="geglu", aux_loss_coeff=1.0)),
    ("b_out_gelu", 8, 6, 5, 4, 2, 0, dict(biases=("b_out",), activation_kind="gelu")),
]


def setup(T, H, F, E, Fs, opts, dtype=F32, seed=0):
    opts = dict(opts)
    gated = ACTS[opts.get("activation_kind", "swiglu")][0]
    key = jax.random.key(seed)
    kx, kp, kb, kg = jax.random.split(key, 4)
    x = jax.random.normal(kx, (T, H)).astype(dtype)
    params = make_params(kp, H, F, E, Fs, gated, dtype)
    if opts.pop("bias", False):
        opts["expert_bias"] = 0.1 * jax.random.normal(kb, (E,))
    biases = opts.pop("biases", ())  # the expert FFNs' biases: "b_in", "b_out" or both
    kbi, kbo = jax.random.split(kb)
    if "b_in" in biases:
        params = params._replace(b_in=jax.random.normal(kbi, params.w_in.shape[::2]).astype(dtype))
    if "b_out" in biases:
        params = params._replace(b_out=jax.random.normal(kbo, (E, H)).astype(dtype))
    g = jax.random.normal(kg, (T, H))
    return x, params, opts, g


def weighted_loss(layer, g):
    """The scalar whose gradients the tests compare: layer's (out, aux_loss, z_loss) against the
    cotangent g, plus the losses."""
    def f(x, params):
        out, aux, z = layer(x, params)
        return jnp.sum(out.astype(F32) * g) + 0.7 * aux + 1.3 * z
    return f


def assert_values_and_grads_close(got, want, got_g, want_g):
    """(out, aux_loss, z_loss) and the gradients to (x, params), ours against the reference's."""
    for name, a, b in zip(("out", "aux_loss", "z_loss"), got, want):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=name)
    names = ["x"] + [f"params.{f}" for f in mj.MoeParams._fields]
    for name, a, b in zip(names, jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        scale = float(jnp.max(jnp.abs(b))) + 1e-6
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * scale, err_msg=f"d {name}")


@FUSED
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_layer_matches_the_pure_jax_layer_values_and_gradients(case, fused):
    _, T, H, F, E, k, Fs, opts = case
    x, params, opts, g = setup(T, H, F, E, Fs, opts)
    opts["fused"] = fused

    def ours(x, params):
        out, a = mj.moe_layer(x, params, k=k, **opts)
        return out, a.aux_loss, a.z_loss

    def ref(x, params):
        return ref_layer(x, params, k=k, **without_fused(opts))[:3]

    _, aux = mj.moe_layer(x, params, k=k, **opts)
    np.testing.assert_array_equal(aux.tokens_per_expert,
                                  ref_layer(x, params, k=k, **without_fused(opts))[3])
    loss = functools.partial(weighted_loss, g=g)
    assert_values_and_grads_close(jax.jit(ours)(x, params), ref(x, params),
                                  jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(x, params),
                                  jax.grad(loss(ref), argnums=(0, 1))(x, params))


# expert_weights_transposed: w_in [E, 2F | F, H] and w_out [E, H, F] read as they lie, against the
# pure-JAX layer on the default layout (the same values), values and gradients (the weights'
# in their own layout); the lowered program transposes no more than the default layout's.
TRANSPOSED_CASES = [c for c in CASES if c[0] in ("mixtral", "deepseek_v3", "sigmoid_gelu",
                                                 "gpt_oss_biases")]


@FUSED
@pytest.mark.parametrize("case", TRANSPOSED_CASES, ids=[c[0] for c in TRANSPOSED_CASES])
def test_expert_weights_transposed_are_read_as_they_lie(case, fused):
    _, T, H, F, E, k, Fs, opts = case
    x, params, opts, g = setup(T, H, F, E, Fs, opts)
    opts["fused"] = fused
    swap = lambda w: jnp.swapaxes(w, 1, 2)  # noqa: E731
    params_t = params._replace(w_in=swap(params.w_in), w_out=swap(params.w_out))

    def ours(x, params_t):
        out, a = mj.moe_layer(x, params_t, k=k, expert_weights_transposed=True, **opts)
        return out, a.aux_loss, a.z_loss

    def ref(x, params):
        return ref_layer(x, params, k=k, **without_fused(opts))[:3]

    loss = functools.partial(weighted_loss, g=g)
    got_g = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(x, params_t)
    want_g = jax.grad(loss(ref), argnums=(0, 1))(x, params)
    want_g = (want_g[0], want_g[1]._replace(w_in=swap(want_g[1].w_in),
                                            w_out=swap(want_g[1].w_out)))
    assert got_g[1].w_in.shape == params_t.w_in.shape
    assert_values_and_grads_close(jax.jit(ours)(x, params_t), ref(x, params), got_g, want_g)

    def default(x, params):
        out, a = mj.moe_layer(x, params, k=k, **opts)
        return out, a.aux_loss, a.z_loss

    def transposes(fn, p):
        return jax.jit(jax.grad(loss(fn), argnums=(0, 1))).lower(x, p).as_text().count(
            "stablehlo.transpose")

    assert transposes(ours, params_t) == transposes(default, params)


def test_expert_weights_transposed_errors_name_the_layout():
    x, params, _, _ = setup(5, 8, 3, 4, 0, {})
    # The default layout's weights where [E, out, in] is asked for (and the other way round).
    with pytest.raises(ValueError, match=r"params.w_out must be \[E, H, F\] = \[4, 8, F\], "
                                         r"expert_weights_transposed, got \(4, 3, 8\)"):
        mj.moe_layer(x, params, k=2, expert_weights_transposed=True)
    swapped = params._replace(w_out=jnp.swapaxes(params.w_out, 1, 2))
    with pytest.raises(ValueError, match=r"params.w_in must be \[4, 6, 8\] \(\[E, 2F, H\], "
                                         r"gate \| up, expert_weights_transposed\), got"):
        mj.moe_layer(x, swapped, k=2, expert_weights_transposed=True)
    with pytest.raises(TypeError, match="expert_weights_transposed"):
        mj.moe_layer(x, params, k=2, expert_weights_transposed="yes")


@FUSED
def test_bf16_follows_f32(fused):
    T, H, F, E, k = 33, 64, 24, 8, 2
    x, params, _, g = setup(T, H, F, E, 16, {}, dtype=F32, seed=3)
    x16 = x.astype(BF16)
    params = params._replace(b_in=0.1 * jax.random.normal(jax.random.key(4), (E, 2 * F)),
                             b_out=0.1 * jax.random.normal(jax.random.key(5), (E, H)))
    params16 = jax.tree.map(lambda w: w.astype(BF16), params)
    # The f32 layer on the bf16-rounded inputs is the target; bf16 rounds each intermediate.
    x32 = x16.astype(F32)
    params32 = jax.tree.map(lambda w: w.astype(F32), params16)
    want, _ = mj.moe_layer(x32, params32, k=k, fused=fused)
    got, _ = mj.moe_layer(x16, params16, k=k, fused=fused)
    assert got.dtype == BF16
    err = jnp.linalg.norm(got.astype(F32) - want) / jnp.linalg.norm(want)
    assert float(err) < 0.02, float(err)
    d16 = jax.grad(lambda p: jnp.sum(mj.moe_layer(x16, p, k=k, fused=fused)[0].astype(F32) * g))(
        params16)
    d32 = jax.grad(lambda p: jnp.sum(mj.moe_layer(x32, p, k=k, fused=fused)[0] * g))(params32)
    for name, a, b in zip(mj.MoeParams._fields, d16, d32):
        err = jnp.linalg.norm(a.astype(F32) - b) / jnp.linalg.norm(b)
        assert float(err) < 0.03, (name, float(err))


def capacity_keep(weights, idx, E, capacity_factor, policy):
    """SPEC.md section 3's drops in NumPy: each expert keeps at most ceil(T * k / E * cf) of its
    slots, the highest weights (ties: the earlier token, then the lower slot) or the earliest."""
    T, k = idx.shape
    cap = int(np.ceil(T * k / E * capacity_factor))
    keep = np.zeros((T, k), np.float32)
    for e in range(E):
        slots = [(t, s) for t in range(T) for s in range(k) if idx[t, s] == e]
        if policy == "probs":
            slots.sort(key=lambda ts: (-weights[ts], ts[0], ts[1]))
        for t, s in slots[:cap]:
            keep[t, s] = 1.0
    return keep


@FUSED
@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_exactly_the_slots_the_spec_says(policy, fused):
    T, H, F, E, k, cf = 24, 8, 5, 4, 2, 0.75
    x, params, _, g = setup(T, H, F, E, 0, {}, seed=5)
    r = ref_route(x @ params.router, k)
    keep = capacity_keep(np.asarray(r.topk_weights), np.asarray(r.topk_indices), E, cf, policy)
    assert 0 < keep.sum() < T * k  # some slots are dropped, not all
    out, aux = mj.moe_layer(x, params, k=k, capacity_factor=cf, drop_policy=policy, fused=fused)
    want = ref_layer(x, params, k=k, keep=keep)[0]
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    kept_per_expert = np.bincount(np.asarray(r.topk_indices)[keep > 0], minlength=E)
    np.testing.assert_array_equal(aux.tokens_per_expert, kept_per_expert)
    got_g = jax.grad(lambda p: jnp.sum(mj.moe_layer(x, p, k=k, capacity_factor=cf,
                                                    drop_policy=policy, fused=fused)[0] * g))(
        params)
    want_g = jax.grad(lambda p: jnp.sum(ref_layer(x, p, k=k, keep=keep)[0] * g))(params)
    for name, a, b in zip(mj.MoeParams._fields, got_g, want_g):
        if b is None:
            continue
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("dtype", [F32, jnp.bfloat16])
def test_activation_matches_jax_nn(dtype):
    """Values and gradients against jax.nn in float32 (rounded once to dtype), on an odd shape;
    with rows, the rows below it the same and every other row of both 0."""
    h = (jax.random.normal(jax.random.key(1), (7, 14)) * 3).astype(dtype)
    ct = jax.random.normal(jax.random.key(2), (7, 14)).astype(dtype)
    tol = 1e-6 if dtype == F32 else 1e-2
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731

    def close(got, want, what):
        want = f32(want)
        np.testing.assert_allclose(f32(got), want, rtol=tol,
                                   atol=tol * float(np.abs(want).max(initial=0.0)), err_msg=what)

    for kind, (gated, _) in ACTS.items():
        w = 7 if gated else 14
        ref = lambda h: ref_ffn(h.astype(F32), kind).astype(dtype)  # noqa: E731
        close(mj.activation(h, kind), ref(h), kind)
        grad = jax.grad(lambda h: jnp.sum(mj.activation(h, kind).astype(F32) * ct[:, :w]))(h)
        want = jax.grad(lambda h: jnp.sum(ref_ffn(h, kind) * ct[:, :w].astype(F32)))(
            h.astype(F32))
        close(grad, want, f"{kind}: d_h")
        for rows in (0, 4, 7):  # also traced
            got = jax.jit(lambda h, r: mj.activation(h, kind, rows=r))(h, rows)
            close(got[:rows], ref(h)[:rows], f"{kind}: rows {rows}")
            assert not np.any(f32(got[rows:])), f"{kind}: rows past {rows} not 0"
            g = jax.grad(lambda h: jnp.sum(
                mj.activation(h, kind, rows=rows).astype(F32) * ct[:, :w]))(h)
            close(g[:rows], grad[:rows], f"{kind}: d_h, rows {rows}")
            assert not np.any(f32(g[rows:])), f"{kind}: d_h past {rows} not 0"
    with pytest.raises(ValueError, match="kind = 'tanh'"):
        mj.activation(h, "tanh")
    with pytest.raises(ValueError, match="even width"):
        mj.activation(h[:, :7], "swiglu")
    with pytest.raises(Exception, match=r"rows = 8: must be in \[0, h.shape\[0\] = 7\]"):
        jax.block_until_ready(jax.jit(lambda h, r: mj.activation(h, rows=r))(h, 8))
    # A rows known at trace time is checked then.
    with pytest.raises(ValueError, match=r"activation: rows = 8: must be in \[0, h.shape\[0\]\]"):
        mj.activation(h, rows=8)
    with pytest.raises(TypeError, match=r"activation: rows = 2.5: must be an integer"):
        mj.activation(h, rows=2.5)
    with pytest.raises(ValueError, match=r"activation: rows must be a scalar"):
        mj.activation(h, rows=jnp.array([1, 2], jnp.int32))


def test_named_errors():
    x, params, _, _ = setup(5, 8, 3, 4, 0, {})
    with pytest.raises(ValueError, match=r"params.w_in must be \[4, 8, 6\]"):
        mj.moe_layer(x, params._replace(w_in=params.w_in[:, :, :3]), k=2)
    with pytest.raises(ValueError, match="params.router must be"):
        mj.moe_layer(x, params._replace(router=params.router[:7]), k=2)
    with pytest.raises(TypeError, match="params.w_out is bfloat16"):
        mj.moe_layer(x, params._replace(w_out=params.w_out.astype(BF16)), k=2)
    with pytest.raises(TypeError, match="must be a MoeParams or a mapping"):
        mj.moe_layer(x, tuple(params), k=2)
    with pytest.raises(KeyError, match=r"params lacks \['w_out'\]"):
        mj.moe_layer(x, {"router": params.router, "w_in": params.w_in}, k=2)
    with pytest.raises(KeyError, match=r"params has \['w_up'\], which moe_layer does not take"):
        mj.moe_layer(x, {**params._asdict(), "w_up": params.w_in}, k=2)
    with pytest.raises(ValueError, match="give both or neither"):
        mj.moe_layer(x, params._replace(shared_in=jnp.zeros((8, 4))), k=2)
    shared = params._replace(shared_in=jnp.zeros((8, 4)), shared_out=jnp.zeros((2, 8), BF16))
    with pytest.raises(TypeError, match="params.shared_out is bfloat16, x is float32"):
        mj.moe_layer(x, shared, k=2)
    with pytest.raises(ValueError, match=r"shared_out \(3, 8\) must be"):
        mj.moe_layer(x, shared._replace(shared_out=jnp.zeros((3, 8))), k=2)
    with pytest.raises(ValueError, match="k = 5"):
        mj.moe_layer(x, params, k=5)
    with pytest.raises(ValueError, match="activation_kind"):
        mj.moe_layer(x, params, k=2, activation_kind="tanh")
    # The expert biases: [E, 2F | F] and [E, H] in x's dtype.
    with pytest.raises(ValueError, match=r"params.b_in must be \[E, 2F \| F\] = \[4, 6\], got "
                                         r"\(4, 3\)"):
        mj.moe_layer(x, params._replace(b_in=jnp.zeros((4, 3))), k=2)
    with pytest.raises(ValueError, match=r"params.b_out must be \[E, H\] = \[4, 8\]"):
        mj.moe_layer(x, params._replace(b_out=jnp.zeros((8,))), k=2)
    with pytest.raises(TypeError, match="params.b_out is bfloat16, x is float32"):
        mj.moe_layer(x, params._replace(b_out=jnp.zeros((4, 8), BF16)), k=2)


@pytest.mark.parametrize("kw,match", [
    # Every option is moe_layer's to name, on either path, before any step runs.
    (dict(k=2.7), r"moe_layer: k = 2.7: must be an integer"),
    (dict(k=2, score="sigmoid", num_groups=2**32, group_topk=1),
     r"moe_layer: num_groups = 4294967296: must be in \[1, E\] = \[1, 4\]"),
    (dict(k=2, score="sigmoid", num_groups=3, group_topk=1),
     r"moe_layer: num_groups = 3: must divide E = 4"),
    (dict(k=2, scaling_factor=float("inf")), r"moe_layer: scaling_factor = inf"),
    (dict(k=2, capacity_factor=-1.0), r"moe_layer: capacity_factor = -1.0: must be finite and > 0"),
    (dict(k=2, align_size=0), r"moe_layer: align_size = 0: must be in \[1, "),
    (dict(k=2, aux_loss_coeff=float("nan")), r"moe_layer: aux_loss_coeff = nan"),
    (dict(k=2, z_loss_coeff="0.1"), r"moe_layer: z_loss_coeff = '0.1': must be a real number"),
    (dict(k=2, batch_invariant=1), r"moe_layer: batch_invariant = 1: must be True or False"),
    (dict(k=2, fused="yes"), r"moe_layer: fused = 'yes': must be True or False"),
])
@pytest.mark.parametrize("fused", [None, False])
def test_options_are_named_as_moe_layer(kw, match, fused):
    x, params, _, _ = setup(5, 8, 3, 4, 0, {})
    kw = {"fused": fused, **kw}
    with pytest.raises((ValueError, TypeError), match=match):
        jax.eval_shape(lambda x: mj.moe_layer(x, params, **kw), x)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float16])
def test_x_dtype_is_named_as_moe_layer(dtype):
    x, params, _, _ = setup(5, 8, 3, 4, 0, {})
    with pytest.raises(TypeError, match=f"moe_layer: x dtype {jnp.dtype(dtype).name} is not"):
        mj.moe_layer(x.astype(dtype), params, k=2)


@FUSED
@pytest.mark.parametrize("shared", [0, 6])
def test_params_as_a_mapping(shared, fused):
    """A dict with MoeParams' names (as Flax and Equinox hold weights) gives the MoeParams'
    output bit for bit, and gradients in a dict of the same names."""
    x, params, _, _ = setup(9, 8, 3, 4, shared, {})
    as_dict = {name: w for name, w in params._asdict().items() if w is not None}

    def loss(p):
        out, aux = mj.moe_layer(x, p, k=2, aux_loss_coeff=0.01, fused=fused)
        return jnp.sum(out * out) + aux.aux_loss

    np.testing.assert_array_equal(mj.moe_layer(x, as_dict, k=2, fused=fused)[0],
                                  mj.moe_layer(x, params, k=2, fused=fused)[0])
    got, want = jax.grad(loss)(as_dict), jax.grad(loss)(params)
    assert isinstance(got, dict) and set(got) == set(as_dict)
    for name, g in got.items():
        np.testing.assert_array_equal(g, getattr(want, name), err_msg=name)


@FUSED
@pytest.mark.parametrize("dtype,shared", [(F32, 0), (F32, 24), (BF16, 24)])
def test_batch_invariant_token_is_the_same_bits_in_any_batch(dtype, shared, fused):
    """batch_invariant=True: a probe token's output and its gradient (x and d_out rows) are the
    same bits at T = 1, 7, 64, 512, first, middle or last among other tokens."""
    H, F, E, k = 96, 40, 8, 2
    params = make_params(jax.random.PRNGKey(5), H, F, E, shared, dtype=dtype)
    probe = jax.random.normal(jax.random.PRNGKey(6), (H,)).astype(dtype)
    g_probe = jax.random.normal(jax.random.PRNGKey(7), (H,)).astype(dtype)

    @jax.jit
    def run(x, g):
        def loss(x):
            out, _ = mj.moe_layer(x, params, k=k, batch_invariant=True, fused=fused)
            return jnp.sum(out.astype(F32) * g.astype(F32)), out
        (_, out), d_x = jax.value_and_grad(loss, has_aux=True)(x)
        return out, d_x

    want = None
    for T, at in ((1, 0), (7, 3), (64, 63), (512, 0), (512, 301)):
        x = jax.random.normal(jax.random.PRNGKey(T), (T, H)).astype(dtype).at[at].set(probe)
        g = jax.random.normal(jax.random.PRNGKey(T + 1), (T, H)).astype(dtype).at[at].set(g_probe)
        out, d_x = run(x, g)
        got = (np.asarray(out[at]).view(np.uint8), np.asarray(d_x[at]).view(np.uint8))
        if want is None:
            want = got
        assert np.array_equal(got[0], want[0]), f"out differs at T = {T}, token {at}"
        assert np.array_equal(got[1], want[1]), f"d_x differs at T = {T}, token {at}"


# (name, T, H, F, E, k, Fs, options) for the fused call against the steps: the edges of the
# token count, every row in one group, alignment, capacity, and every routing option at once.
FUSED_CASES = [
    ("no_tokens", 0, 8, 5, 4, 2, 3, dict(aux_loss_coeff=0.1, z_loss_coeff=0.1)),
    ("one_token", 1, 8, 5, 4, 2, 0, dict(aux_loss_coeff=0.1)),
    ("one_group", 19, 8, 5, 4, 1, 0, dict(one_group=True, aux_loss_coeff=0.1)),
    ("aligned", 17, 12, 7, 6, 3, 0, dict(align_size=4)),
    ("capacity_aligned", 23, 12, 7, 6, 2, 5,
     dict(capacity_factor=0.8, drop_policy="position", align_size=3)),
    ("sigmoid_groups_bias", 21, 16, 5, 16, 4, 5,
     dict(score="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5, bias=True,
          aux_loss_coeff=1.0, z_loss_coeff=0.5, activation_kind="geglu")),
    # The expert FFNs' biases on padding rows (alignment, and a capacity padded to it).
    ("biases_aligned", 17, 12, 7, 6, 3, 0, dict(align_size=4, biases=("b_in", "b_out"))),
    ("biases_one_group", 19, 8, 5, 4, 1, 0,
     dict(one_group=True, biases=("b_in", "b_out"), aux_loss_coeff=0.1)),
    ("biases_no_tokens", 0, 8, 5, 4, 2, 0, dict(biases=("b_in", "b_out"))),
    ("biases_capacity", 23, 12, 7, 6, 2, 5,
     dict(capacity_factor=0.8, align_size=3, biases=("b_in", "b_out"), aux_loss_coeff=0.1)),
]


@pytest.mark.parametrize("case", FUSED_CASES, ids=[c[0] for c in FUSED_CASES])
def test_fused_equals_the_steps(case):
    """The one-call layer against the step-by-step one: outputs, losses, tokens_per_expert and
    every gradient (f32: both sum in f32, in other orders)."""
    _, T, H, F, E, k, Fs, opts = case
    x, params, opts, g = setup(T, H, F, E, Fs, opts, seed=T)
    if opts.pop("one_group", False):  # every token's logit largest at expert 2
        x = jnp.abs(x)
        params = params._replace(router=jnp.zeros((H, E)).at[:, 2].set(1.0))

    def run(fused):
        def loss(x, params):
            out, aux = mj.moe_layer(x, params, k=k, fused=fused, **opts)
            return jnp.sum(out * g) + 0.7 * aux.aux_loss + 1.3 * aux.z_loss, (out, aux)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, params)

    (l1, (out1, aux1)), g1 = run(True)
    (l2, (out2, aux2)), g2 = run(False)
    if case[0] in ("one_group", "biases_one_group"):
        assert aux1.tokens_per_expert.tolist() == [0, 0, T, 0]
    np.testing.assert_array_equal(aux1.tokens_per_expert, aux2.tokens_per_expert)
    scale = float(jnp.max(jnp.abs(out2), initial=0.0)) + 1e-6
    np.testing.assert_allclose(out1, out2, rtol=1e-5, atol=1e-5 * scale)
    for name, a, b in (("loss", l1, l2), ("aux_loss", aux1.aux_loss, aux2.aux_loss),
                       ("z_loss", aux1.z_loss, aux2.z_loss)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)
    names = ["x"] + [f"params.{f}" for f in mj.MoeParams._fields]
    for name, a, b in zip(names, jax.tree.leaves(g1), jax.tree.leaves(g2)):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        scale = float(jnp.max(jnp.abs(b), initial=0.0)) + 1e-6
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale, err_msg=f"d {name}")


def test_fused_residual_outlives_its_jit():
    """The forward's saved activations, kept by jax.vjp as a residual, serve a backward run
    later in a call of its own (after other layers ran in between), as with a jitted forward
    and backward: the same bits as one jitted value_and_grad."""
    x, params, _, g = setup(13, 16, 9, 8, 6, {}, seed=9)
    layer = jax.jit(lambda x, p: mj.moe_layer(x, p, k=2, fused=True)[0])
    out, vjp = jax.vjp(layer, x, params)
    other = setup(29, 16, 9, 8, 6, {}, seed=10)
    jax.block_until_ready(jax.vjp(layer, other[0], other[1])[1](other[3]))  # another call between
    d_x, d_p = vjp(g)
    want_dx, want_dp = jax.jit(jax.grad(lambda x, p: jnp.sum(layer(x, p) * g), argnums=(0, 1)))(
        x, params)
    np.testing.assert_array_equal(out, layer(x, params))
    np.testing.assert_array_equal(d_x, want_dx)
    for name, a, b in zip(mj.MoeParams._fields, d_p, want_dp):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_fused_under_vmap_is_a_loop_of_layers():
    x, params, _, _ = setup(11, 8, 5, 4, 0, {}, seed=2)
    xs = jnp.stack([x, -x, 2 * x])
    got, aux = jax.vmap(lambda x: mj.moe_layer(x, params, k=2, fused=True))(xs)
    for i in range(3):
        want, want_aux = mj.moe_layer(xs[i], params, k=2, fused=True)
        np.testing.assert_array_equal(got[i], want)
        np.testing.assert_array_equal(aux.tokens_per_expert[i], want_aux.tokens_per_expert)


def _layer_attrs(H, F, E, k, **options):
    """The fused handlers' attributes: softmax routing, SwiGLU, dropless, no losses."""
    fields = dict(hidden=H, ffn=F, num_experts=E, shared_ffn=0, k=k, score=0, pre_softmax=False,
                  num_groups=0, group_topk=0, scaling_factor=1.0, activation=0,
                  capacity_factor=0.0, drop_policy=0, align_size=1, aux_loss_coeff=0.0,
                  aux_loss_sequences=0, z_loss_coeff=0.0, batch_invariant=False,
                  expert_weights_transposed=False, expert_weights_packed=False)
    return _ffi.layer_attrs(**{**fields, **options})


def test_fused_backward_reads_a_residual_moved_to_another_alignment():
    """The residual's header gives its data's offset: a copy of it whose data sits one byte
    further, at no 64-byte boundary, gives the backward the same bits (the data copied once more
    to an aligned place), as should XLA ever hand the residual back elsewhere."""
    H, F, E, k = 16, 9, 8, 2
    x, params, _, g = setup(13, H, F, E, 0, {}, seed=4)
    attrs = _layer_attrs(H, F, E, k, aux_loss_coeff=0.1)
    none = jnp.zeros((0,), F32)
    weights = (params.router, params.w_in, params.w_out, none, none, none, none)
    _, residuals = jax.jit(_layer_fwd, static_argnums=3)(x, weights, none, attrs)
    saved = np.asarray(residuals[3])
    offset = int(saved[:8].view(np.uint64)[0])
    moved = jax.device_put(np.concatenate([
        np.array([offset + 1], np.uint64).view(np.uint8), saved[8:offset], np.zeros(1, np.uint8),
        saved[offset:]]))
    assert (moved.unsafe_buffer_pointer() + offset + 1) % 64 != 0  # the data is misaligned
    ct = (g, mj.MoeAux(jnp.array(0.5, F32), jnp.zeros((), F32), None))
    bwd = jax.jit(_layer_bwd, static_argnums=0)
    want = bwd(attrs, residuals, ct)
    got = bwd(attrs, residuals[:3] + (moved,), ct)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)


def test_fused_errors():
    x, params, _, _ = setup(5, 8, 3, 4, 0, {})
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("ep",))
    with pytest.raises(ValueError, match="fused = True runs on the CPU without ep_axis"):
        jax.shard_map(lambda x: mj.moe_layer(x, params, k=2, ep_axis="ep", fused=True)[0],
                      mesh=mesh, in_specs=jax.P("ep"), out_specs=jax.P("ep"))(x)
    # A backward given bytes that no forward wrote names them (the header is checked).
    attrs = _layer_attrs(8, 3, 4, 2)
    saved_bytes, _, scratch_bytes = _ffi.layer_workspace(attrs, 5, False)
    none = jnp.zeros((0,), F32)
    weights = (params.router, params.w_in, params.w_out, none, none, none, none)
    results = [(a.shape, a.dtype) for a in (x, *weights)] + [((scratch_bytes,), jnp.uint8)]
    with pytest.raises(Exception, match="saved is not a residual of moekit's moe_layer forward"):
        jax.block_until_ready(_ffi.call(
            "moekit_layer_bwd", results, x, *weights, jnp.zeros((0,), F32),
            jnp.zeros((saved_bytes,), jnp.uint8), x, jnp.zeros((), F32), jnp.zeros((), F32),
            **dict(attrs)))
    with pytest.raises(TypeError, match="are not LayerAttrs'"):
        _ffi.layer_attrs(hidden=8)
    # A config the C++ layer refuses (hidden past int32) has no sizes.
    assert _ffi.layer_workspace(_layer_attrs(2**31, 3, 4, 2), 5, False) is None


def test_bench_script_runs_and_prints_its_json():
    # bench/jax_layer.py at 4 tokens: per pass one object with each implementation's time (the
    # C++ layer's from build/moekit, which `make test` builds first) and the JAX layers' outputs
    # against moekit's, within bf16 rounding.
    root = pathlib.Path(__file__).parents[2]
    done = subprocess.run([sys.executable, str(root / "bench" / "jax_layer.py"), "--preset",
                           "olmoe-1b-7b", "--tokens", "4", "--impls", "moekit,steps,lax,cpp",
                           "--rounds", "1", "--reps", "1", "--warmup", "0", "--json"],
                          capture_output=True, text=True, check=True)
    cases = json.loads(done.stdout)
    assert [c["pass"] for c in cases] == ["fwd", "fwd+bwd"]
    for c in cases:
        assert c["preset"] == "olmoe-1b-7b" and c["tokens"] == 4 and c["device"] == "cpu"
        for impl in ("moekit", "steps", "lax", "cpp"):
            assert c[f"{impl}_ms"] > 0 and c[f"{impl}_rounds_ms"] == [c[f"{impl}_ms"]]
        for impl in ("moekit", "steps", "lax"):  # XLA's temporaries, from the compiled function
            assert 0 <= c[f"{impl}_xla_temp_gib"] < 64
        assert c["steps_vs_moekit_max_rel_diff"] < 0.02
        assert c["lax_vs_moekit_max_rel_diff"] < 0.02
    assert "moekit/cpp" in done.stderr and "lax/moekit" in done.stderr


def test_bench_script_times_the_forward_on_packed_weights():
    # --packed-weights: the forward only, moekit.jax's and the C++ layer's, on packed weights.
    root = pathlib.Path(__file__).parents[2]
    done = subprocess.run([sys.executable, str(root / "bench" / "jax_layer.py"), "--preset",
                           "olmoe-1b-7b", "--tokens", "3", "--packed-weights", "--rounds", "1",
                           "--reps", "1", "--warmup", "0", "--json"],
                          capture_output=True, text=True, check=True)
    cases = json.loads(done.stdout)
    assert [(c["pass"], c["packed_weights"]) for c in cases] == [("fwd", True)]
    assert cases[0]["moekit_ms"] > 0 and cases[0]["cpp_ms"] > 0
    assert "the forward on packed experts' weights" in done.stderr
    refused = subprocess.run([sys.executable, str(root / "bench" / "jax_layer.py"),
                              "--packed-weights", "--impls", "moekit,steps"],
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "--packed-weights: the forward" in refused.stderr


def test_bench_summary_takes_each_rounds_ratio_or_the_medians(tmp_path):
    """bench/summarize_jax_layer.py: where both layers ran in one process, the median of each
    round's own ratio; where each ran in processes of its own, each JAX round over the C++
    rounds' median."""
    row = dict(op="jax_layer", tokens=4)
    both = [{**row, "preset": "both", "pass": "fwd", "moekit_rounds_ms": [10.0, 30.0, 12.0],
             "cpp_rounds_ms": [10.0, 10.0, 10.0]}]
    alone = [[{**row, "preset": "apart", "pass": "fwd", "moekit_rounds_ms": [22.0]}],
             [{**row, "preset": "apart", "pass": "fwd", "cpp_rounds_ms": [10.0]}],
             [{**row, "preset": "apart", "pass": "fwd", "moekit_rounds_ms": [26.0]}],
             [{**row, "preset": "apart", "pass": "fwd", "cpp_rounds_ms": [30.0]}]]
    for i, rows in enumerate([both] + alone):
        (tmp_path / f"{i}.json").write_text(json.dumps(rows))
    root = pathlib.Path(__file__).parents[2]
    done = subprocess.run([sys.executable, str(root / "bench" / "summarize_jax_layer.py"),
                           str(tmp_path)], capture_output=True, text=True, check=True)
    lines = {line.split()[0]: line for line in done.stdout.splitlines()[1:]}
    assert "1.20x  1.00, 3.00, 1.20 (in one process)" in lines["both"]
    # cpp's median of 10 and 30 is 20: 22 / 20, 26 / 20.
    assert "1.20x  1.10, 1.30 (processes alternating" in lines["apart"]


def test_bench_script_skips_a_preset_over_its_memory_limit():
    # --preset all on this machine runs every preset but deepseek-v3 (22 GiB of bf16 expert
    # weights): under a limit below every preset's needs, each is skipped, named, and nothing is
    # allocated or timed.
    root = pathlib.Path(__file__).parents[2]
    done = subprocess.run([sys.executable, str(root / "bench" / "jax_layer.py"), "--preset", "all",
                           "--tokens", "4", "--mem-limit-gib", "0.01", "--json"],
                          capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == []
    presets = json.loads((root / "bench" / "presets.json").read_text())["presets"]
    for p in presets:
        assert f"skipped {p['name']}: needs about" in done.stderr
    assert "over --mem-limit-gib 0.01" in done.stderr


@FUSED
@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 4), (12,)], ids=["BS", "ABS", "T"])
def test_any_leading_axes_are_the_flattened_tokens(shape, fused):
    """x [..., H] is the layer on x.reshape(-1, H): out reshaped back, the same losses, counts and
    gradients, bit for bit."""
    T = math.prod(shape)
    x, params, _, g = setup(T, 8, 5, 4, 3, {})
    kw = dict(k=2, aux_loss_coeff=0.1, z_loss_coeff=0.01, fused=fused)

    def loss(x, params):
        out, aux = mj.moe_layer(x, params, **kw)
        return jnp.sum(out.astype(F32).reshape(T, -1) * g) + aux.aux_loss + aux.z_loss, (out, aux)

    xs = x.reshape(*shape, 8)
    (v, (out, aux)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(xs, params)
    (v2, (out2, aux2)), grads2 = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)
    assert out.shape == (*shape, 8)
    np.testing.assert_array_equal(out.reshape(T, 8), out2)
    for a, b in zip(aux, aux2):
        np.testing.assert_array_equal(a, b)
    assert grads[0].shape == xs.shape
    np.testing.assert_array_equal(grads[0].reshape(T, 8), grads2[0])
    for a, b in zip(jax.tree.leaves(grads[1]), jax.tree.leaves(grads2[1])):
        np.testing.assert_array_equal(a, b)


@FUSED
def test_one_token_as_a_vector(fused):
    """x [H]: one token, the layer on x[None] with out [H] and d_x [H]."""
    x, params, _, g = setup(1, 8, 5, 4, 3, {})

    def loss(x):
        out = mj.moe_layer(x, params, k=2, aux_loss_coeff=0.1, fused=fused)[0]
        return jnp.sum(out.astype(F32).reshape(1, -1) * g), out

    (v, out), d_x = jax.value_and_grad(loss, has_aux=True)(x[0])
    (v1, out1), d_x1 = jax.value_and_grad(loss, has_aux=True)(x)
    assert out.shape == (8,) and d_x.shape == (8,)
    np.testing.assert_array_equal(out, out1[0])
    np.testing.assert_array_equal(d_x, d_x1[0])


@FUSED
@pytest.mark.parametrize("B,S", [(3, 5), (1, 7), (4, 1), (2, 0)])
def test_per_sequence_loss_against_jnp(B, S, fused):
    """aux_loss_per_sequence on x [B, S, H]: the mean over the B sequences of each one's
    load-balancing loss on its own counts (S tokens), value and gradient to x and the router,
    against the loss written in jnp."""
    H, E, k, coeff = 8, 6, 2, 0.1
    x, params, _, _ = setup(B * S, H, 5, E, 0, {})
    xs = x.reshape(B, S, H)

    def moekit(x, router):
        return mj.moe_layer(x, params._replace(router=router), k=k, aux_loss_coeff=coeff,
                            aux_loss_per_sequence=True, fused=fused)[1].aux_loss

    def ref(x, router):
        logits = jnp.dot(x, router, preferred_element_type=F32)  # [B, S, E]
        scores = jax.nn.softmax(logits, axis=-1)
        _, idx = jax.lax.top_k(jax.lax.stop_gradient(scores), k)
        counts = jnp.sum(jax.nn.one_hot(idx, E, dtype=F32), axis=(1, 2))  # [B, E]
        if S == 0:  # no tokens: the loss is 0
            return jnp.sum(scores)
        per = E * coeff / (k * S * S) * jnp.sum(jnp.sum(scores, axis=1) * counts, axis=-1)
        return jnp.mean(per)

    got = jax.value_and_grad(moekit, argnums=(0, 1))(xs, params.router)
    want = jax.value_and_grad(ref, argnums=(0, 1))(xs, params.router)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-7)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    if B > 1 and S > 1:  # the batch-level loss differs: the option is not ignored
        batch = mj.moe_layer(xs, params, k=k, aux_loss_coeff=coeff, fused=fused)[1].aux_loss
        assert abs(float(batch) - float(got[0])) > 1e-6


def test_token_axes_errors():
    """token_axes names the manual axes the tokens are split over besides ep_axis: an axis that
    is not one, ep_axis itself, a repeat, or a non-name is refused, naming moe_layer."""
    x, params, _, _ = setup(4, 8, 3, 4, 0, {})
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "ep"))
    spec = mj.MoeParams(jax.P(), jax.P("ep"), jax.P("ep"))

    def call(**kw):
        return jax.shard_map(lambda x, p: mj.moe_layer(x, p, k=2, **kw)[0], mesh=mesh,
                             in_specs=(jax.P(("data", "ep")), spec),
                             out_specs=jax.P(("data", "ep")))(x, params)
    with pytest.raises(ValueError, match="moe_layer: token_axes = 'ep' names ep_axis 'ep'"):
        call(ep_axis="ep", token_axes="ep")
    with pytest.raises(ValueError, match="'fsdp' is not a manual axis"):
        call(ep_axis="ep", token_axes=("data", "fsdp"))
    with pytest.raises(ValueError, match="names an axis twice"):
        call(token_axes=("data", "data"))
    with pytest.raises(TypeError, match="must be a mesh axis name or a tuple of them"):
        call(token_axes=(0,))
    with pytest.raises(ValueError, match="is not a manual axis"):  # outside shard_map
        mj.moe_layer(x, params, k=2, token_axes="data")
    # Over axes of size 1 the layer is the one-device layer.
    np.testing.assert_allclose(call(ep_axis="ep", token_axes="data"),
                               mj.moe_layer(x, params, k=2)[0], rtol=1e-6, atol=1e-6)


def test_per_sequence_loss_needs_sequences():
    x, params, _, _ = setup(6, 8, 5, 4, 0, {})
    with pytest.raises(ValueError,
                       match=r"moe_layer: aux_loss_per_sequence needs x \[\.\.\., S, H\]"):
        mj.moe_layer(x, params, k=2, aux_loss_coeff=0.1, aux_loss_per_sequence=True)
    with pytest.raises(TypeError, match=r"moe_layer: aux_loss_per_sequence = 'yes'"):
        mj.moe_layer(x.reshape(2, 3, 8), params, k=2, aux_loss_per_sequence="yes")
    with pytest.raises(ValueError, match=r"moe_layer: x must be \[\.\.\., H\], got a scalar"):
        mj.moe_layer(x[0, 0], params, k=2)
