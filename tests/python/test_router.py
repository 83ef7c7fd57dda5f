"""moekit.jax's router (route, aux_loss_scores, load_balancing_loss, z_loss) against pure-JAX
references written here from SPEC.md section 2 with jax.lax.top_k: values and gradients, under
jit, and the named errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import moekit.jax as mj

F32, BF16 = jnp.float32, jnp.bfloat16


def _act(score, x):
    if score == "sigmoid":
        return jax.nn.sigmoid(x)
    return jnp.sqrt(jax.nn.softplus(x))


def ref_route(logits, k, score="softmax", pre_softmax=False, num_groups=None, group_topk=None,
              scaling_factor=1.0, expert_bias=None):
    """SPEC.md section 2 in JAX: choose with lax.top_k (ties to the lower index), weight, scale,
    and order by descending weight (ties to the lower index)."""
    x = logits.astype(F32)
    T, E = x.shape
    if score == "softmax" and not pre_softmax:
        s, key = None, x
    elif score == "softmax":
        s = jax.nn.softmax(x, axis=-1)
        key = s
    else:
        s = _act(score, x)
        key = s if expert_bias is None else s + expert_bias
    key = jax.lax.stop_gradient(key)
    if num_groups:
        per = E // num_groups
        group_score = jax.lax.top_k(key.reshape(T, num_groups, per), k // group_topk)[0].sum(-1)
        _, kept = jax.lax.top_k(group_score, group_topk)
        allowed = jnp.zeros((T, num_groups), bool).at[jnp.arange(T)[:, None], kept].set(True)
        key = jnp.where(jnp.repeat(allowed, per, axis=1), key, -jnp.inf)
    _, idx = jax.lax.top_k(key, k)
    if s is None:
        w = jax.nn.softmax(jnp.take_along_axis(x, idx, axis=1), axis=-1)
    else:
        w = jnp.take_along_axis(s, idx, axis=1)
        if score != "softmax" and k > 1:
            w = w / (w.sum(-1, keepdims=True) + 1e-20)
    w = w * scaling_factor
    # Descending weight, ties to the lower index: sort by index, then stably by -weight.
    by_index = jnp.argsort(idx, axis=1)
    idx, w = (jnp.take_along_axis(a, by_index, axis=1) for a in (idx, w))
    by_weight = jnp.argsort(-jax.lax.stop_gradient(w), axis=1, stable=True)
    idx, w = (jnp.take_along_axis(a, by_weight, axis=1) for a in (idx, w))
    rows = jnp.arange(T)[:, None]
    probs = jnp.zeros((T, E), F32).at[rows, idx].set(w)
    routing_map = jnp.zeros((T, E), bool).at[rows, idx].set(True)
    return mj.Route(probs, routing_map, idx.astype(jnp.int32), w)


# (E, k, options): every score, pre and post, groups, bias, scaling; k = 1 and k = E.
ROUTE_CASES = [
    (8, 2, dict()),
    (8, 8, dict()),
    (37, 1, dict()),
    (64, 6, dict(pre_softmax=True)),
    (32, 4, dict(score="sigmoid", num_groups=8, group_topk=4, scaling_factor=2.5, bias=True)),
    (32, 4, dict(score="sigmoid", bias=True)),
    (24, 4, dict(score="sqrtsoftplus", num_groups=4, group_topk=2)),
    (16, 1, dict(score="sigmoid", scaling_factor=0.5)),
]


def _route_inputs(T, E, opts, dtype=F32, seed=0):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.standard_normal((T, E)), dtype)
    opts = dict(opts)
    if opts.pop("bias", False):
        opts["expert_bias"] = jnp.asarray(rng.standard_normal(E) * 0.1, F32)
    return logits, opts


@pytest.mark.parametrize("E,k,opts", ROUTE_CASES)
@pytest.mark.parametrize("T", [1, 3, 100])
def test_route_matches_reference(T, E, k, opts):
    logits, opts = _route_inputs(T, E, opts, seed=T + E + k)
    got = jax.jit(lambda l: mj.route(l, k, **opts))(logits)
    want = ref_route(logits, k, **opts)
    np.testing.assert_array_equal(got.topk_indices, want.topk_indices)
    np.testing.assert_array_equal(got.routing_map, want.routing_map)
    np.testing.assert_allclose(got.topk_weights, want.topk_weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.probs, want.probs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("E,k,opts", ROUTE_CASES)
def test_route_gradient_matches_reference(E, k, opts):
    T = 23
    logits, opts = _route_inputs(T, E, opts, seed=E * k)
    rng = np.random.default_rng(1)
    c_probs = jnp.asarray(rng.standard_normal((T, E)), F32)
    c_w = jnp.asarray(rng.standard_normal((T, k)), F32)

    def loss(route_fn):
        def f(l):
            r = route_fn(l)
            return (r.probs * c_probs).sum() + (r.topk_weights * c_w).sum()
        return f

    got = jax.jit(jax.grad(loss(lambda l: mj.route(l, k, **opts))))(logits)
    want = jax.grad(loss(lambda l: ref_route(l, k, **opts)))(logits)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_route_bf16_logits():
    logits, _ = _route_inputs(50, 16, {}, dtype=BF16, seed=5)
    got = mj.route(logits, 3)
    want = ref_route(logits, 3)
    assert got.probs.dtype == BF16 and got.topk_weights.dtype == BF16
    np.testing.assert_array_equal(got.topk_indices, want.topk_indices)
    np.testing.assert_allclose(got.topk_weights.astype(F32), want.topk_weights, rtol=1e-2)
    d = jax.grad(lambda l: mj.route(l, 3).topk_weights.astype(F32)[:, 0].sum())(logits)
    d_want = jax.grad(lambda l: ref_route(l, 3).topk_weights[:, 0].sum())(logits.astype(F32))
    assert d.dtype == BF16
    np.testing.assert_allclose(d.astype(F32), d_want, rtol=2e-2, atol=2e-3)


def test_route_no_tokens():
    logits = jnp.zeros((0, 8), F32)
    r = mj.route(logits, 2, score="sigmoid", num_groups=4, group_topk=2)
    assert r.probs.shape == (0, 8) and r.topk_indices.shape == (0, 2)
    d = jax.grad(lambda l: mj.route(l, 2).topk_weights.sum())(logits)
    assert d.shape == (0, 8)


def test_route_ties_go_to_the_lower_index():
    logits = jnp.zeros((2, 6), F32).at[1, 4].set(1.0)
    r = mj.route(logits, 3)
    np.testing.assert_array_equal(r.topk_indices, [[0, 1, 2], [4, 0, 1]])


def _nan_rule_row(x, k, score, pre_softmax):
    """The C++ router's NaN rule (moekit/router.h) for one row, in NumPy: a NaN score ranks
    below every number (-inf too), NaNs by index; the weights follow the formulas (NaN wherever
    they take a NaN); the output order by weight puts NaN weights last."""
    with np.errstate(invalid="ignore", over="ignore"):  # -inf - -inf: NaN, as the rule says
        return _nan_rule_row_values(x.astype(np.float64), k, score, pre_softmax)


def _nan_rule_row_values(x, k, score, pre_softmax):
    if score == "softmax" and pre_softmax:
        s = np.full_like(x, np.nan) if np.isnan(x).any() else np.exp(x - x.max()) / np.exp(
            x - x.max()).sum()
    elif score == "softmax":
        s = x
    else:
        s = 1.0 / (1.0 + np.exp(-x))

    def rank(v, i):
        return (bool(np.isnan(v)), 0.0 if np.isnan(v) else -v, i)

    chosen = sorted(range(len(x)), key=lambda e: rank(s[e], e))[:k]
    if score == "softmax" and not pre_softmax:
        xc = x[chosen]
        w = np.full(k, np.nan) if np.isnan(xc).any() else np.exp(xc - xc.max()) / np.exp(
            xc - xc.max()).sum()
    else:
        w = s[chosen]
        if score != "softmax" and k > 1:
            w = w / (w.sum() + 1e-20)
    order = sorted(range(k), key=lambda i: rank(w[i], chosen[i]))
    return [chosen[i] for i in order], w[order]


@pytest.mark.parametrize("score,pre_softmax", [("softmax", False), ("softmax", True),
                                               ("sigmoid", False)])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_route_follows_the_nan_rule(score, pre_softmax, k):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 16)).astype(np.float32)
    x[1, 3] = np.nan                       # one NaN
    x[2, ::2] = np.nan                     # half
    x[3, :] = np.nan                       # all
    x[4, :] = -np.inf                      # NaN beside -inf
    x[4, 5::3] = np.nan
    x[5, 7], x[5, 9] = np.nan, np.inf      # beside +inf
    r = mj.route(jnp.asarray(x), k, score=score, pre_softmax=pre_softmax)
    for t in range(x.shape[0]):
        idx, w = _nan_rule_row(x[t], k, score, pre_softmax)
        np.testing.assert_array_equal(r.topk_indices[t], idx, err_msg=f"row {t}")
        np.testing.assert_allclose(r.topk_weights[t], w, rtol=1e-5, equal_nan=True,
                                   err_msg=f"row {t}")


def test_route_under_vmap_is_a_loop_of_calls():
    logits, _ = _route_inputs(12, 8, {}, seed=3)
    batch = jnp.stack([logits, -logits])
    got = jax.vmap(lambda l: mj.route(l, 2).topk_indices)(batch)
    for b in range(2):
        np.testing.assert_array_equal(got[b], ref_route(batch[b], 2).topk_indices)


@pytest.mark.parametrize("score", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_aux_loss_scores_values_and_gradient(score):
    logits, _ = _route_inputs(31, 12, {}, seed=7)

    def ref(l):
        if score == "softmax":
            q = jax.nn.softmax(l, axis=-1)
        else:
            s = _act(score, l)
            q = s / (s.sum(-1, keepdims=True) + 1e-20)
        return q

    q, m = mj.aux_loss_scores(logits, 3, score=score)
    np.testing.assert_allclose(q, ref(logits), rtol=1e-5, atol=1e-7)
    _, top = jax.lax.top_k(ref(logits), 3)
    want_map = jnp.zeros(m.shape, bool).at[jnp.arange(31)[:, None], top].set(True)
    np.testing.assert_array_equal(m, want_map)
    c = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), F32)
    got = jax.grad(lambda l: (mj.aux_loss_scores(l, 3, score=score)[0] * c).sum())(logits)
    want = jax.grad(lambda l: (ref(l) * c).sum())(logits)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    check_grads(lambda l: mj.aux_loss_scores(l, 3, score=score)[0], (logits,), order=1,
                modes=["rev"], atol=1e-2, rtol=1e-2)


def test_load_balancing_loss_batch_and_sequence():
    T, E, k, B = 24, 8, 2, 3
    logits, _ = _route_inputs(T, E, {}, seed=11)
    q, m = mj.aux_loss_scores(logits, k)
    tpe = m.sum(0).astype(jnp.int32)

    def ref(q, total):
        return E * 0.1 / (k * total**2) * (q.sum(0) * tpe).sum()

    np.testing.assert_allclose(mj.load_balancing_loss(q, tpe, k=k, coeff=0.1), ref(q, T),
                               rtol=1e-5)
    np.testing.assert_allclose(mj.load_balancing_loss(q, tpe, k=k, coeff=0.1, total_tokens=96),
                               ref(q, 96), rtol=1e-5)
    g = jax.grad(lambda q: mj.load_balancing_loss(q, tpe, k=k, coeff=0.1))(q)
    np.testing.assert_allclose(g, jax.grad(lambda q: ref(q, T))(q), rtol=1e-5)

    S = T // B
    per_seq = m.reshape(B, S, E).sum(1).astype(jnp.int32)

    def ref_seq(q):
        qs = q.reshape(B, S, E).sum(1)
        return (E * 0.1 / (k * S**2) * (qs * per_seq).sum(-1)).mean()

    np.testing.assert_allclose(mj.load_balancing_loss(q, per_seq, k=k, coeff=0.1), ref_seq(q),
                               rtol=1e-5)
    g = jax.grad(lambda q: mj.load_balancing_loss(q, per_seq, k=k, coeff=0.1))(q)
    np.testing.assert_allclose(g, jax.grad(ref_seq)(q), rtol=1e-5)


def test_z_loss_and_gradient():
    logits, _ = _route_inputs(17, 9, {}, seed=13)
    ref = lambda l: 0.01 * jnp.mean(jax.nn.logsumexp(l, axis=-1) ** 2)
    np.testing.assert_allclose(jax.jit(lambda l: mj.z_loss(l, 0.01))(logits), ref(logits),
                               rtol=1e-5)
    np.testing.assert_allclose(jax.grad(lambda l: mj.z_loss(l, 0.01))(logits),
                               jax.grad(ref)(logits), rtol=1e-4, atol=1e-8)
    assert float(mj.z_loss(jnp.zeros((0, 4), F32))) == 0.0


@pytest.mark.parametrize("call,match", [
    (lambda l: mj.route(l, 9), r"route: k = 9: must be in \[1, E\] = \[1, 8\]"),
    (lambda l: mj.route(l, 2, score="relu"), r"score = 'relu'"),
    (lambda l: mj.route(l, 2, expert_bias=jnp.zeros(8)), r"expert_bias needs score"),
    (lambda l: mj.route(l, 2, score="sigmoid", expert_bias=jnp.zeros(7)),
     r"expert_bias must be \[E\] = \[8\]"),
    (lambda l: mj.route(l, 2, num_groups=4), r"give both or neither"),
    (lambda l: mj.route(l[0], 2), r"logits must be \[T, E\]"),
    (lambda l: mj.route(l.astype(jnp.int32), 2), r"logits dtype int32"),
    (lambda l: mj.aux_loss_scores(l, 0), r"aux_loss_scores: k = 0"),
    (lambda l: mj.load_balancing_loss(l, jnp.zeros((1, 2, 8), jnp.int32), k=2),
     r"tokens_per_expert must be \[E\] or \[B, E\]"),
    (lambda l: mj.load_balancing_loss(l, jnp.zeros((2, 8), jnp.int32), k=2, total_tokens=8),
     r"total_tokens = 8 with per-sequence counts"),
    (lambda l: mj.z_loss(l.astype(jnp.int32)), r"z_loss: logits dtype int32"),
    # As a new user would try them: nothing truncated, wrapped or overflowing unnamed.
    (lambda l: mj.route(l, 2.7), r"route: k = 2.7: must be an integer"),
    (lambda l: mj.route(l, True), r"route: k = True: must be an integer, not a bool"),
    (lambda l: mj.route(l, np.int64(9)), r"route: k = 9: must be in \[1, E\] = \[1, 8\]"),
    (lambda l: mj.route(l, 2, score="sigmoid", num_groups=2**32, group_topk=1),
     r"route: num_groups = 4294967296: must be in \[1, E\] = \[1, 8\]"),
    (lambda l: mj.route(l, 2, score="sigmoid", num_groups=4, group_topk=5),
     r"route: group_topk = 5: must be in \[1, num_groups\] = \[1, 4\]"),
    (lambda l: mj.route(l, 3, score="sigmoid", num_groups=4, group_topk=2),
     r"route: group_topk = 2: must divide k = 3"),
    (lambda l: mj.route(l, 6, score="sigmoid", num_groups=4, group_topk=2),
     r"route: k = 6: k / group_topk = 3 must be <= the 2 experts of a group"),
    (lambda l: mj.route(l, 2, num_groups=1.5, group_topk=1), r"num_groups = 1.5: must be an int"),
    (lambda l: mj.route(l, 2, scaling_factor=float("nan")),
     r"route: scaling_factor = nan: must be finite in float32"),
    (lambda l: mj.route(l, 2, scaling_factor=1e39), r"scaling_factor = 1e\+39: must be finite"),
    (lambda l: mj.route(l, 2, scaling_factor="2"), r"scaling_factor = '2': must be a real"),
    (lambda l: mj.route(l, 2, pre_softmax="yes"), r"pre_softmax = 'yes': must be True or False"),
    (lambda l: mj.aux_loss_scores(l, 2.0), r"aux_loss_scores: k = 2.0: must be an integer"),
    (lambda l: mj.load_balancing_loss(l, jnp.zeros(8, jnp.int32), k=2, coeff=float("inf")),
     r"load_balancing_loss: coeff = inf: must be finite"),
    (lambda l: mj.load_balancing_loss(l, jnp.zeros(8, jnp.int32), k=0),
     r"load_balancing_loss: k = 0: must be in \[1, 2\^31 - 1\]"),
    (lambda l: mj.load_balancing_loss(l, jnp.zeros(8, jnp.int32), k=2, total_tokens=-1),
     r"load_balancing_loss: total_tokens = -1: must be in \[0, "),
    (lambda l: mj.z_loss(l, float("nan")), r"z_loss: coeff = nan: must be finite"),
])
def test_invalid_options_are_named_at_trace_time(call, match):
    logits = jnp.zeros((4, 8), F32)
    with pytest.raises((ValueError, TypeError), match=match):
        call(logits)


def test_invalid_groups_are_named_at_trace_time():
    # The C++ router's rule and message (check_route_options), raised before anything runs.
    with pytest.raises(ValueError, match=r"route: num_groups = 3: must divide E = 8"):
        jax.eval_shape(lambda l: mj.route(l, 2, score="sigmoid", num_groups=3, group_topk=1),
                       jnp.zeros((4, 8), F32))


@pytest.mark.parametrize("T,E,B", [(0, 4, None), (13, 5, None), (12, 6, 3), (7, 3, 1),
                                   (9, 4, 9)])
def test_count_tokens_per_expert(T, E, B):
    rng = np.random.default_rng(T * 10 + E)
    m = rng.random((T, E)) < 0.4
    if T:
        m[:, 0] = True  # one expert chosen by every token
    got = mj.count_tokens_per_expert(jnp.asarray(m), num_sequences=B)
    want = m.sum(0) if B is None else m.reshape(B, T // B, E).sum(1)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(
        jax.jit(lambda m: mj.count_tokens_per_expert(m, B))(jnp.asarray(m)), want)


def test_counts_of_a_route_are_permutes_group_sizes():
    """The counts of route's map are the group sizes permute makes of its indices (dropless),
    every row of the sum k per token; one expert holding every row too."""
    logits, _ = _route_inputs(21, 8, {}, seed=5)
    r = mj.route(logits, 3)
    counts = mj.count_tokens_per_expert(r.routing_map)
    p = mj.permute(jnp.zeros((21, 4), F32), r.topk_indices, num_experts=8)
    np.testing.assert_array_equal(counts, p.tokens_per_expert)
    assert int(jnp.sum(counts)) == 21 * 3
    bias = jnp.asarray([9.0] + [0.0] * 7)  # every token chooses expert 0
    one = mj.route(logits, 1, score="sigmoid", expert_bias=bias)
    np.testing.assert_array_equal(mj.count_tokens_per_expert(one.routing_map),
                                  [21] + [0] * 7)


def test_update_expert_bias():
    counts = np.array([3, 5, 4, 0, 8, 4], np.int32)  # mean 4
    bias = np.array([0.1, -0.2, 0.3, 0.0, 1.0, -1.0], np.float32)
    want = bias + np.float32(0.01) * np.sign(counts.mean() - counts).astype(np.float32)
    b = jnp.asarray(bias)
    got = mj.update_expert_bias(b, counts, 0.01)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(b, bias)  # the argument, not donated, is left as it was
    # Inside jit, the argument still used after the call keeps its value (XLA copies it first).
    both = jax.jit(lambda b, c: (mj.update_expert_bias(b, c, 0.01), b * 2))(b, counts)
    np.testing.assert_array_equal(both[0], want)
    np.testing.assert_array_equal(both[1], bias * 2)
    # Donated: updated in its buffer.
    donated = jax.jit(lambda b, c: mj.update_expert_bias(b, c, 0.01), donate_argnums=0)
    np.testing.assert_array_equal(donated(jnp.asarray(bias), jnp.asarray(counts)), want)
    # Wider counts, and a step of the loop it is written for.
    step = jax.jit(lambda b, m: mj.update_expert_bias(b, mj.count_tokens_per_expert(m), 0.5))
    m = jnp.asarray(np.eye(6, dtype=bool)[[0, 0, 1, 2, 3, 4]])  # counts 2 1 1 1 1 0, mean 1
    np.testing.assert_array_equal(step(jnp.zeros(6, F32), m),
                                  np.array([-0.5, 0, 0, 0, 0, 0.5], np.float32))
    assert mj.update_expert_bias(jnp.zeros(0, F32), jnp.zeros(0, jnp.int32), 1.0).shape == (0,)
    # Not differentiated.
    g = jax.grad(lambda b: jnp.sum(mj.update_expert_bias(b, counts, 0.01)))(b)
    np.testing.assert_array_equal(g, np.zeros(6, np.float32))


@pytest.mark.parametrize("call,match", [
    (lambda: mj.count_tokens_per_expert(jnp.zeros((4, 3), jnp.int32)),
     r"count_tokens_per_expert: routing_map dtype int32 is not bool"),
    (lambda: mj.count_tokens_per_expert(jnp.zeros((6, 3), bool), num_sequences=4),
     r"count_tokens_per_expert: num_sequences = 4: must divide the 6 tokens"),
    (lambda: mj.count_tokens_per_expert(jnp.zeros((6, 3), bool), num_sequences=0),
     r"count_tokens_per_expert: num_sequences = 0: must be in \[1, "),
    (lambda: mj.update_expert_bias(jnp.zeros(3, F32), jnp.zeros(3, jnp.int32), float("nan")),
     r"update_expert_bias: rate = nan: must be finite"),
    (lambda: mj.update_expert_bias(jnp.zeros(3, jnp.bfloat16), jnp.zeros(3, jnp.int32), 0.1),
     r"update_expert_bias: expert_bias dtype bfloat16 is not float32"),
    (lambda: mj.update_expert_bias(jnp.zeros(3, F32), jnp.zeros(4, jnp.int32), 0.1),
     r"update_expert_bias: tokens_per_expert \(4,\) and expert_bias \(3,\) must both be \[E\]"),
    (lambda: mj.update_expert_bias(jnp.zeros(3, F32), jnp.zeros(3, F32), 0.1),
     r"update_expert_bias: tokens_per_expert must be a rank-1 integer array"),
])
def test_balancing_arguments_are_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_negative_counts_are_named_at_run_time():
    with pytest.raises(Exception, match=r"update_expert_bias: tokens_per_expert\[1\] = -2"):
        jax.block_until_ready(mj.update_expert_bias(jnp.zeros(3, F32),
                                                    jnp.asarray([1, -2, 3], jnp.int32), 0.1))
