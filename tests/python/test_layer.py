"""moekit.jax.moe_layer against a pure-JAX MoE layer written here with jax.lax.top_k (through
test_router's reference router) and jax.lax.ragged_dot: values, the losses, and the gradients to
x and every weight, for each preset's routing on small shapes; capacity mode against drops
worked out here in NumPy from SPEC.md; and the named errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moekit.jax as mj
from test_router import ref_route

F32, BF16 = jnp.float32, jnp.bfloat16

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
    router, w_in, w_out, shared_in, shared_out = (
        None if w is None else w.astype(F32) for w in params)
    T, E = x.shape[0], router.shape[1]
    logits = x32 @ router
    r = ref_route(logits, k, **routing)
    w = r.topk_weights if keep is None else r.topk_weights * keep
    flat = r.topk_indices.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    xs = x32[order // k]
    y = jax.lax.ragged_dot(ref_ffn(jax.lax.ragged_dot(xs, w_in, sizes), activation_kind), w_out,
                           sizes)
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
    g = jax.random.normal(kg, (T, H))
    return x, params, opts, g


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_layer_matches_the_pure_jax_layer_values_and_gradients(case):
    _, T, H, F, E, k, Fs, opts = case
    x, params, opts, g = setup(T, H, F, E, Fs, opts)

    def loss(layer):
        def f(x, params):
            out, aux, z = layer(x, params)
            return jnp.sum(out.astype(F32) * g) + 0.7 * aux + 1.3 * z
        return f

    def ours(x, params):
        out, a = mj.moe_layer(x, params, k=k, **opts)
        return out, a.aux_loss, a.z_loss

    def ref(x, params):
        return ref_layer(x, params, k=k, **opts)[:3]

    got, want = jax.jit(ours)(x, params), ref(x, params)
    for name, a, b in zip(("out", "aux_loss", "z_loss"), got, want):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=name)
    _, aux = mj.moe_layer(x, params, k=k, **opts)
    np.testing.assert_array_equal(aux.tokens_per_expert, ref_layer(x, params, k=k, **opts)[3])

    got_g = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(x, params)
    want_g = jax.grad(loss(ref), argnums=(0, 1))(x, params)
    names = ["x"] + [f"params.{f}" for f in mj.MoeParams._fields]
    for name, a, b in zip(names, jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        scale = float(jnp.max(jnp.abs(b))) + 1e-6
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * scale, err_msg=f"d {name}")


def test_bf16_follows_f32():
    T, H, F, E, k = 33, 64, 24, 8, 2
    x, params, _, g = setup(T, H, F, E, 16, {}, dtype=F32, seed=3)
    x16 = x.astype(BF16)
    params16 = mj.MoeParams(*(w.astype(BF16) for w in params))
    # The f32 layer on the bf16-rounded inputs is the target; bf16 rounds each intermediate.
    x32 = x16.astype(F32)
    params32 = mj.MoeParams(*(w.astype(F32) for w in params16))
    want, _ = mj.moe_layer(x32, params32, k=k)
    got, _ = mj.moe_layer(x16, params16, k=k)
    assert got.dtype == BF16
    err = jnp.linalg.norm(got.astype(F32) - want) / jnp.linalg.norm(want)
    assert float(err) < 0.02, float(err)
    d16 = jax.grad(lambda p: jnp.sum(mj.moe_layer(x16, p, k=k)[0].astype(F32) * g))(params16)
    d32 = jax.grad(lambda p: jnp.sum(mj.moe_layer(x32, p, k=k)[0] * g))(params32)
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


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_exactly_the_slots_the_spec_says(policy):
    T, H, F, E, k, cf = 24, 8, 5, 4, 2, 0.75
    x, params, _, g = setup(T, H, F, E, 0, {}, seed=5)
    r = ref_route(x @ params.router, k)
    keep = capacity_keep(np.asarray(r.topk_weights), np.asarray(r.topk_indices), E, cf, policy)
    assert 0 < keep.sum() < T * k  # some slots are dropped, not all
    out, aux = mj.moe_layer(x, params, k=k, capacity_factor=cf, drop_policy=policy)
    want = ref_layer(x, params, k=k, keep=keep)[0]
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    kept_per_expert = np.bincount(np.asarray(r.topk_indices)[keep > 0], minlength=E)
    np.testing.assert_array_equal(aux.tokens_per_expert, kept_per_expert)
    got_g = jax.grad(lambda p: jnp.sum(mj.moe_layer(x, p, k=k, capacity_factor=cf,
                                                    drop_policy=policy)[0] * g))(params)
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
    with pytest.raises(ValueError, match="k = 5"):
        mj.moe_layer(x, params, k=5)
    with pytest.raises(ValueError, match="activation_kind"):
        mj.moe_layer(x, params, k=2, activation_kind="tanh")


@pytest.mark.parametrize("shared", [0, 6])
def test_params_as_a_mapping(shared):
    """A dict with MoeParams' names (as Flax and Equinox hold weights) gives the MoeParams'
    output bit for bit, and gradients in a dict of the same names."""
    x, params, _, _ = setup(9, 8, 3, 4, shared, {})
    as_dict = {name: w for name, w in params._asdict().items() if w is not None}

    def loss(p):
        out, aux = mj.moe_layer(x, p, k=2, aux_loss_coeff=0.01)
        return jnp.sum(out * out) + aux.aux_loss

    np.testing.assert_array_equal(mj.moe_layer(x, as_dict, k=2)[0],
                                  mj.moe_layer(x, params, k=2)[0])
    got, want = jax.grad(loss)(as_dict), jax.grad(loss)(params)
    assert isinstance(got, dict) and set(got) == set(as_dict)
    for name, g in got.items():
        np.testing.assert_array_equal(g, getattr(want, name), err_msg=name)


@pytest.mark.parametrize("dtype,shared", [(F32, 0), (F32, 24), (BF16, 24)])
def test_batch_invariant_token_is_the_same_bits_in_any_batch(dtype, shared):
    """batch_invariant=True: a probe token's output and its gradient (x and d_out rows) are the
    same bits at T = 1, 7, 64, 512, first, middle or last among other tokens."""
    H, F, E, k = 96, 40, 8, 2
    params = make_params(jax.random.PRNGKey(5), H, F, E, shared, dtype=dtype)
    probe = jax.random.normal(jax.random.PRNGKey(6), (H,)).astype(dtype)
    g_probe = jax.random.normal(jax.random.PRNGKey(7), (H,)).astype(dtype)

    @jax.jit
    def run(x, g):
        def loss(x):
            out, _ = mj.moe_layer(x, params, k=k, batch_invariant=True)
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
