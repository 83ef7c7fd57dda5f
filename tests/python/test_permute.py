"""moekit.jax's permutation (permute, unpermute, sort_chunks_by_index) against pure-JAX and
NumPy references written here from SPEC.md section 3: values and gradients, dropless, aligned
and with a capacity, both routing forms, under jit, and the named errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moekit.jax as mj

F32, BF16 = jnp.float32, jnp.bfloat16


def _routing(T, E, k, seed, skew=False):
    """[T, k] distinct experts per token (skewed toward expert 0 when asked) and their probs."""
    rng = np.random.default_rng(seed)
    p = np.arange(E, 0, -1.0) ** 3 if skew else np.ones(E)
    idx = np.stack([rng.choice(E, k, replace=False, p=p / p.sum()) for _ in range(T)])
    probs = rng.random((T, k)).astype(np.float32)
    return idx.astype(np.int32), probs


def ref_plan(idx, E, align=1, capacity=None, probs=None, policy="probs"):
    """row[t, s] (-1: dropped) and tokens_per_expert, by SPEC.md section 3, in NumPy."""
    T, k = idx.shape
    row = -np.ones((T, k), np.int64)
    tpe = np.zeros(E, np.int64)
    start = 0
    for e in range(E):
        slots = [(t, s) for t in range(T) for s in range(k) if idx[t, s] == e]
        if capacity is not None and len(slots) > capacity:
            if policy == "probs":  # highest probs; ties: the earlier token, then the lower slot
                keep = sorted(slots, key=lambda ts: (-probs[ts], ts))[:capacity]
            else:
                keep = slots[:capacity]
            slots = sorted(keep)
        for j, (t, s) in enumerate(slots):
            row[t, s] = start + j
        n = len(slots)
        tpe[e] = -(-n // align) * align
        start += tpe[e]
    return row, tpe


def ref_permute(x, probs, row, N):
    """x_perm and probs_perm from the plan, with jnp scatters (differentiable)."""
    T, k = row.shape
    flat = row.reshape(-1)
    keep = flat >= 0
    src = np.repeat(np.arange(T), k)[keep]
    x_perm = jnp.zeros((N, x.shape[1]), x.dtype).at[flat[keep]].set(x[src])
    p_perm = jnp.zeros((N,), probs.dtype).at[flat[keep]].set(probs.reshape(-1)[keep])
    return x_perm, p_perm


def ref_unpermute(y, row, w):
    safe = np.where(row >= 0, row, 0)
    w = jnp.where(jnp.asarray(row >= 0), w, 0.0)
    return jnp.einsum("tk,tkh->th", w, y[safe])


CASES = [
    # T, E, k, H, align, capacity_factor, drop_policy
    (1, 1, 1, 3, None, None, "probs"),
    (7, 4, 2, 5, None, None, "probs"),
    (33, 8, 3, 17, 4, None, "probs"),       # aligned blocks
    (40, 6, 2, 9, None, 1.0, "probs"),      # capacity: skewed routing drops
    (40, 6, 2, 9, None, 1.0, "position"),
    (40, 6, 2, 9, 8, 1.5, "probs"),         # capacity and alignment
    (40, 6, 2, 9, 8, 1.5, "position"),
    (64, 16, 8, 33, None, None, "probs"),   # k = 8 of 16
]


@pytest.mark.parametrize("T,E,k,H,align,cf,policy", CASES)
def test_permute_unpermute_values_and_gradients(T, E, k, H, align, cf, policy):
    idx, probs = _routing(T, E, k, seed=T + E, skew=cf is not None)
    rng = np.random.default_rng(T)
    x = jnp.asarray(rng.standard_normal((T, H)), F32)
    probs = jnp.asarray(probs)
    capacity = None if cf is None else int(np.ceil(T * k / E * cf))
    row, tpe = ref_plan(idx, E, align or 1, capacity, np.asarray(probs), policy)
    if cf is not None:
        assert (row < 0).any(), "the skewed routing should drop slots"

    perm_fn = jax.jit(lambda x, p: mj.permute(x, idx, p, num_experts=E, align_size=align,
                                              capacity_factor=cf, drop_policy=policy))
    perm = perm_fn(x, probs)
    N = perm.x.shape[0]
    assert N >= tpe.sum()
    np.testing.assert_array_equal(perm.tokens_per_expert, tpe)
    np.testing.assert_array_equal(perm.row_map[0], row)
    np.testing.assert_array_equal(perm.row_map[1], idx)  # every slot routed, dropped or not
    np.testing.assert_array_equal(perm.pad_offsets, np.concatenate(
        [[0], np.cumsum(tpe - np.bincount(idx[row >= 0], minlength=E))[:-1]]))
    x_want, p_want = ref_permute(x, probs, row, N)
    np.testing.assert_array_equal(perm.x, x_want)
    np.testing.assert_array_equal(perm.probs, p_want)

    w = jnp.asarray(rng.random((T, k)), F32)
    out = jax.jit(lambda y, w: mj.unpermute(y, perm, w))(perm.x * 2.0, w)
    np.testing.assert_allclose(out, ref_unpermute(x_want * 2.0, row, w), rtol=1e-6, atol=1e-6)

    # Gradients of the whole round trip, to x, probs and the merging probs.
    c_y = jnp.asarray(rng.standard_normal((N, H)), F32)
    c_out = jnp.asarray(rng.standard_normal((T, H)), F32)
    c_p = jnp.asarray(rng.standard_normal(N), F32)

    def loss(x, probs, w):
        p = mj.permute(x, idx, probs, num_experts=E, align_size=align, capacity_factor=cf,
                       drop_policy=policy)
        return (mj.unpermute(p.x * c_y, p, w) * c_out).sum() + (p.probs * c_p).sum()

    def loss_ref(x, probs, w):
        xp, pp = ref_permute(x, probs, row, N)
        return (ref_unpermute(xp * c_y, row, w) * c_out).sum() + (pp * c_p).sum()

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, probs, w)
    want = jax.grad(loss_ref, argnums=(0, 1, 2))(x, probs, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_routing_map_form_equals_the_indices_form():
    T, E, k, H = 19, 8, 3, 6
    idx, probs = _routing(T, E, k, seed=4)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((T, H)), BF16)
    routing_map = np.zeros((T, E), bool)
    routing_map[np.arange(T)[:, None], idx] = True
    dense_probs = np.zeros((T, E), np.float32)
    dense_probs[np.arange(T)[:, None], idx] = probs
    a = mj.permute(x, idx, num_experts=E)
    b = mj.permute(x, routing_map, dense_probs, k=k)
    assert b.x.dtype == BF16 and b.row_map.shape == (2, T, E)
    np.testing.assert_array_equal(a.tokens_per_expert, b.tokens_per_expert)
    # The map form takes slots in expert order within a token; the rows are the same set.
    np.testing.assert_array_equal(a.x, b.x)
    out = mj.unpermute(b.x, b, dense_probs)
    want = (x.astype(F32) * probs.sum(1, keepdims=True)).astype(BF16)
    np.testing.assert_allclose(out.astype(F32), want.astype(F32), rtol=1e-2, atol=1e-2)


def test_pad_to_capacity_extra_rows_and_no_merging_probs():
    """pad_to_capacity gives every expert exactly the capacity rows; a larger num_out_tokens
    leaves zero rows past the blocks; unpermute without merging probs sums the copies (weight 1)
    and its gradient reaches y."""
    T, E, k, H = 30, 5, 2, 7
    idx, probs = _routing(T, E, k, seed=8, skew=True)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((T, H)), F32)
    capacity = int(np.ceil(T * k / E * 1.0))
    p = mj.permute(x, idx, jnp.asarray(probs, BF16), num_experts=E, capacity_factor=1.0,
                   pad_to_capacity=True)
    np.testing.assert_array_equal(p.tokens_per_expert, [capacity] * E)
    assert p.x.shape == (E * capacity, H) and p.probs.dtype == BF16
    row, _ = ref_plan(idx, E, 1, capacity, probs)
    # Each block starts at e * capacity; ref_plan packs blocks, so shift its rows.
    kept = np.bincount(idx[row >= 0], minlength=E)
    shift = np.arange(E) * capacity - np.concatenate([[0], np.cumsum(kept)[:-1]])
    want_row = np.where(row >= 0, row + shift[idx], -1)
    np.testing.assert_array_equal(p.row_map[0], want_row)
    np.testing.assert_array_equal(p.pad_offsets,
                                  np.concatenate([[0], np.cumsum(capacity - kept)[:-1]]))

    q = mj.permute(x, idx, num_experts=E, num_out_tokens=T * k + 9)
    assert q.probs is None and q.x.shape == (T * k + 9, H)
    np.testing.assert_array_equal(q.x[T * k:], 0)
    out = mj.unpermute(q.x, q)
    np.testing.assert_allclose(out, k * x, rtol=1e-6)
    c = jnp.asarray(np.random.default_rng(4).standard_normal((T, H)), F32)
    d_y = jax.grad(lambda y: (mj.unpermute(y, q) * c).sum())(q.x)
    d_want = jnp.zeros_like(q.x).at[q.row_map[0].reshape(-1)].set(jnp.repeat(c, k, axis=0))
    np.testing.assert_array_equal(d_y, d_want)


def test_no_tokens():
    p = mj.permute(jnp.zeros((0, 4), F32), jnp.zeros((0, 2), jnp.int32), num_experts=3)
    assert p.x.shape == (0, 4)
    np.testing.assert_array_equal(p.tokens_per_expert, [0, 0, 0])
    assert mj.unpermute(p.x, p).shape == (0, 4)


@pytest.mark.parametrize("with_probs", [False, True])
def test_sort_chunks_by_index_and_its_inverse(with_probs):
    rng = np.random.default_rng(9)
    split = np.array([3, 0, 5, 2], np.int32)
    order = np.array([2, 0, 3, 1], np.int32)
    x = jnp.asarray(rng.standard_normal((12, 4)), F32)  # 2 rows past the chunks
    p = jnp.asarray(rng.random(12), F32)
    chunks = np.split(np.arange(10), np.cumsum(split)[:-1])
    perm = np.concatenate([chunks[c] for c in order] + [np.arange(10, 12)])
    args = (x, split, order) + ((p,) if with_probs else ())
    out = mj.sort_chunks_by_index(*args)
    got_x = out[0] if with_probs else out
    np.testing.assert_array_equal(got_x, x[perm])
    if with_probs:
        np.testing.assert_array_equal(out[1], p[perm])
    back = mj.sort_chunks_by_index(got_x, split[order], np.argsort(order).astype(np.int32))
    np.testing.assert_array_equal(back, x)
    inv = mj.sort_chunks_by_index(got_x, split, order, inverse=True)
    np.testing.assert_array_equal(inv, x)
    c = jnp.asarray(rng.standard_normal((12, 4)), F32)
    g = jax.grad(lambda x: (mj.sort_chunks_by_index(x, split, order) * c).sum())(x)
    np.testing.assert_array_equal(g, c[np.argsort(perm)])


@pytest.mark.parametrize("call,match", [
    (lambda x, i: mj.permute(x, i), r"num_experts is needed"),
    (lambda x, i: mj.permute(x[:3], i, num_experts=4), r"routing_map has 5 rows, x has 3"),
    (lambda x, i: mj.permute(x, i, jnp.zeros((5, 3)), num_experts=4),
     r"probs must be \[T, S\] = \[5, 2\]"),
    (lambda x, i: mj.permute(x, i, num_experts=4, drop_policy="random"), r"drop_policy"),
    (lambda x, i: mj.permute(x, i > 0), r"give k or num_out_tokens"),
    (lambda x, i: mj.permute(x.astype(jnp.int32), i, num_experts=4), r"x dtype int32"),
    (lambda x, i: mj.sort_chunks_by_index(x, jnp.ones(2, jnp.int32), jnp.zeros(3, jnp.int32)),
     r"differ in length"),
    # Sizes past what the permuted rows can hold (i32 rows), once wrapped or a crash.
    (lambda x, i: mj.permute(x, i, num_experts=4, align_size=2**31), r"align_size = 2147483648"),
    (lambda x, i: mj.permute(x, i, num_experts=4, align_size=0), r"align_size = 0"),
    (lambda x, i: mj.permute(x, i, num_experts=4, capacity_factor=float("inf")),
     r"capacity_factor = inf"),
    (lambda x, i: mj.permute(x, i, num_experts=4, capacity_factor=0.0), r"capacity_factor = 0"),
    (lambda x, i: mj.permute(x, i, num_experts=4, capacity_factor=1e19, pad_to_capacity=True),
     r"could exceed 2\^31 - 1"),
    (lambda x, i: mj.permute(x, i, num_experts=4, align_size=2**30), r"could exceed 2\^31 - 1"),
    (lambda x, i: mj.permute(x, i, num_experts=2**31), r"num_experts = 2147483648"),
    (lambda x, i: mj.permute(x, i, num_experts=4, num_out_tokens=-1),
     r"permute: num_out_tokens = -1: must be in \[0, 2\^31 - 1\]"),
    (lambda x, i: mj.permute(x, i, num_experts=4, num_out_tokens=2.5),
     r"permute: num_out_tokens = 2.5: must be an integer"),
    (lambda x, i: mj.permute(x, i, num_experts=4.0), r"permute: num_experts = 4.0: must be an int"),
    (lambda x, i: mj.permute(x, i > 0, k=2.5), r"permute: k = 2.5: must be an integer"),
    (lambda x, i: mj.permute(x, i, num_experts=4, align_size=8.0),
     r"permute: align_size = 8.0: must be an integer"),
    (lambda x, i: mj.permute(x, i, num_experts=4, capacity_factor="1"),
     r"permute: capacity_factor = '1': must be a real number"),
    (lambda x, i: mj.permute(x, i, num_experts=4, capacity_factor=1.0, pad_to_capacity="no"),
     r"permute: pad_to_capacity = 'no': must be True or False"),
    (lambda x, i: mj.sort_chunks_by_index(x, jnp.ones(2, jnp.int32), jnp.zeros(2, jnp.int32),
                                          inverse="yes"),
     r"sort_chunks_by_index: inverse = 'yes': must be True or False"),
])
def test_invalid_arguments_are_named_at_trace_time(call, match):
    x = jnp.zeros((5, 3), F32)
    idx = jnp.zeros((5, 2), jnp.int32)
    with pytest.raises((ValueError, TypeError), match=match):
        call(x, idx)


@pytest.mark.parametrize("capacity_factor", [1e19, 1e300])
def test_a_capacity_past_every_row_keeps_every_slot(capacity_factor):
    """ceil(T * k / E * capacity_factor) past int64 (once a crash): every slot kept, as
    dropless."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((6, 3)), F32)
    idx = jnp.asarray(rng.integers(0, 4, (6, 2)), jnp.int32)
    probs = jnp.asarray(rng.random((6, 2)), F32)
    got = mj.permute(x, idx, probs, num_experts=4, capacity_factor=capacity_factor)
    want = mj.permute(x, idx, probs, num_experts=4)
    for a, b in zip(got, want):
        if a is not None:
            np.testing.assert_array_equal(a, b)


def test_invalid_data_is_named_at_run_time():
    x = jnp.zeros((3, 2), F32)
    bad = jnp.asarray([[0, 1], [2, 7], [1, 0]], jnp.int32)
    with pytest.raises(Exception, match=r"permute: topk_indices\[1, 1\] = 7: must be an expert"):
        jax.block_until_ready(mj.permute(x, bad, num_experts=4).x)
    with pytest.raises(Exception, match=r"num_out_tokens too small"):
        jax.block_until_ready(mj.permute(x, bad % 4, num_experts=4, num_out_tokens=5).x)
