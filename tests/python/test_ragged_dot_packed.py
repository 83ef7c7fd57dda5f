"""moekit.jax.pack_ragged_rhs and ragged_dot on packed weights (the CPU's inference forward):
the layout against its documented index, the forward against the masked reference and against
the same weights unpacked, with group_offset, under jit and vmap, and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moekit.jax as mj
from test_ragged_dot import CASES, masked_reference

F32, BF16 = jnp.float32, jnp.bfloat16


def _bf16(rng, shape):
    # Sixty-fourths in [-1, 1]: exact in bfloat16, their products exact in float32.
    return jnp.asarray(rng.integers(-64, 65, shape) / 64.0, BF16)


@pytest.mark.parametrize("K,n", [(1, 1), (2, 32), (5, 33), (64, 48), (33, 17), (0, 8), (4, 0)])
@pytest.mark.parametrize("transposed", [False, True], ids=["EKn", "EnK"])
def test_layout_is_the_documented_index(K, n, transposed):
    w = _bf16(np.random.default_rng(K * 100 + n), (3, K, n))
    packed = mj.pack_ragged_rhs(jnp.swapaxes(w, 1, 2) if transposed else w,
                                rhs_transposed=transposed)
    pairs, panels = -(-K // 2), -(-n // 32)
    assert packed.data.shape == (3, panels, 64 * pairs) and packed.data.dtype == BF16
    assert (packed.k, packed.n, packed.num_local) == (K, n, 3)
    want = np.zeros((3, panels, 64 * pairs), np.float32)
    for j in range(3):
        for k in range(K):
            for c in range(n):
                want[j, c // 32, 64 * (k // 2) + 2 * (c % 32) + k % 2] = float(w[j, k, c])
    np.testing.assert_array_equal(np.asarray(packed.data, np.float32), want)  # padding 0


@pytest.mark.parametrize("transposed", [False, True], ids=["EKn", "EnK"])
@pytest.mark.parametrize("m,K,n,sizes", CASES + [(40, 7, 70, [13, 0, 27])])
def test_forward_equals_the_masked_reference_and_the_unpacked_weights(m, K, n, sizes, transposed):
    rng = np.random.default_rng(m + K + n)
    num_groups = len(sizes)
    lhs, gs = _bf16(rng, (m, K)), jnp.asarray(sizes, jnp.int32)
    for num_local in sorted({1, max(1, num_groups // 2), num_groups}):
        w = _bf16(rng, (num_local, K, n))
        packed = mj.pack_ragged_rhs(jnp.swapaxes(w, 1, 2) if transposed else w,
                                    rhs_transposed=transposed)
        for offset in range(num_groups - num_local + 1):
            got = mj.ragged_dot(lhs, packed, gs, group_offset=offset,
                                preferred_element_type=F32)
            want = masked_reference(lhs.astype(F32), w.astype(F32), gs, offset)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * K)
            unpacked = mj.ragged_dot(lhs, w, gs, group_offset=offset)
            got_bf16 = mj.ragged_dot(lhs, packed, gs, group_offset=offset)
            assert got_bf16.dtype == BF16 and got_bf16.shape == (m, n)
            np.testing.assert_allclose(np.asarray(got_bf16, np.float32),
                                       np.asarray(unpacked, np.float32), rtol=1e-2, atol=1e-2)


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
    with pytest.raises(TypeError, match="pack_ragged_rhs: rhs dtype float32 is not bfloat16"):
        mj.pack_ragged_rhs(w.astype(F32))
    with pytest.raises(ValueError, match="pack_ragged_rhs: rhs"):
        mj.pack_ragged_rhs(w[0])
    with pytest.raises(TypeError, match="ragged_dot: lhs dtype float32 is not bfloat16"):
        mj.ragged_dot(jnp.zeros((7, 8), F32), packed, gs)
    with pytest.raises(ValueError, match=r"lhs.shape\[1\] = 9 differs from the packed weights' K = 8"):
        mj.ragged_dot(jnp.zeros((7, 9), BF16), packed, gs)
    with pytest.raises(ValueError, match="group_sizes has 3 groups but rhs holds 2"):
        mj.ragged_dot(jnp.zeros((7, 8), BF16), packed, jnp.asarray([1, 2, 3], jnp.int32))
    with pytest.raises(TypeError, match="packed weights .PackedRhs. serve the forward only"):
        jax.grad(lambda a: jnp.sum(mj.ragged_dot(a, packed, gs).astype(F32)))(
            jnp.ones((7, 8), BF16))
    with pytest.raises(Exception, match="group_sizes"):  # the C++ library's, at run time
        mj.ragged_dot(jnp.zeros((7, 8), BF16), packed, jnp.asarray([-1, 4], jnp.int32)) \
            .block_until_ready()
