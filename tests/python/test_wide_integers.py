"""Sizes, offsets and indices wider than int32 (int64 under jax_enable_x64, uint32, uint64): each
value is checked, never narrowed silently (issue 22). In range they compute what int32 does; out
of range they are a ValueError naming the call, the argument, the index and the value at trace
time where known, and an error when the program runs where traced."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moekit.jax as mj

BIG = 2**32 + 2  # narrowed to int32 it would be 2


def _calls():
    """name -> (argument, fn(value) -> result, a valid int32 value, where to put BIG in it)."""
    lhs = jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 7
    rhs = jnp.arange(30, dtype=jnp.float32).reshape(2, 3, 5) / 11
    x = jnp.arange(15, dtype=jnp.float32).reshape(5, 3)
    scores = jnp.full((4, 3), 1 / 3, jnp.float32)
    return {
        "group_sizes": ("ragged_dot: group_sizes",
                        lambda v: mj.ragged_dot(lhs, rhs, v), np.array([2, 2]), 0),
        "group_offset": ("ragged_dot: group_offset",
                         lambda v: mj.ragged_dot(lhs, rhs[:1], jnp.array([1, 3], jnp.int32),
                                                 group_offset=v), np.array(1), ()),
        "topk_indices": ("permute: routing_map",
                         lambda v: mj.permute(x, v, num_experts=3).x,
                         np.array([[0, 2], [1, 0], [2, 1], [0, 1], [2, 2]]), (1, 1)),
        "split_sizes": ("sort_chunks_by_index: split_sizes",
                        lambda v: mj.sort_chunks_by_index(x, v, jnp.array([1, 0], jnp.int32)),
                        np.array([2, 3]), 1),
        "sorted_index": ("sort_chunks_by_index: sorted_index",
                         lambda v: mj.sort_chunks_by_index(x, jnp.array([2, 3], jnp.int32), v),
                         np.array([1, 0]), 0),
        "tokens_per_expert": ("load_balancing_loss: tokens_per_expert",
                              lambda v: mj.load_balancing_loss(scores, v, k=1),
                              np.array([1, 2, 1]), 2),
    }


@pytest.mark.parametrize("case", sorted(_calls()))
@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.uint32])
def test_wide_integers_in_range_compute_what_int32_does(case, dtype):
    _, fn, value, _ = _calls()[case]
    want = np.asarray(fn(jnp.asarray(value, jnp.int32)))
    with jax.enable_x64(True):
        wide = jnp.asarray(value.astype(dtype))
        assert wide.dtype == dtype
        np.testing.assert_array_equal(np.asarray(fn(wide)), want)  # known at trace time
        np.testing.assert_array_equal(np.asarray(jax.jit(fn)(wide)), want)  # traced


@pytest.mark.parametrize("case", sorted(_calls()))
@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_wide_integers_out_of_range_are_named_errors(case, dtype):
    what, fn, value, where = _calls()[case]
    bad = value.astype(dtype)
    bad[where] = BIG
    index = [int(i) for i in np.atleast_1d(where)] if where != () else []
    # Known at trace time: named there (a known group_offset by its range check).
    static = (f"{what} = {BIG} is outside" if case == "group_offset" else
              f"{what}{index} = {BIG} does not fit int32")
    with jax.enable_x64(True):
        with pytest.raises(ValueError, match=re.escape(static)):
            fn(jnp.asarray(bad))
        # Traced: when the program runs, at the flat index of the value.
        flat = int(np.ravel_multi_index(index, bad.shape)) if index else 0
        with pytest.raises(Exception, match=re.escape(f"{what}[{flat}] = {BIG}: does not fit")):
            jax.block_until_ready(jax.jit(fn)(jnp.asarray(bad)))


def test_uint32_past_int32_is_refused():
    lhs, rhs = jnp.ones((4, 3), jnp.float32), jnp.ones((2, 3, 5), jnp.float32)
    sizes = jnp.array([2**31, 2], jnp.uint32)
    with pytest.raises(ValueError, match=r"group_sizes\[0\] = 2147483648 does not fit int32"):
        mj.ragged_dot(lhs, rhs, sizes)
    with pytest.raises(Exception, match=r"group_sizes\[0\] = 2147483648: does not fit int32"):
        jax.block_until_ready(jax.jit(lambda s: mj.ragged_dot(lhs, rhs, s))(sizes))
