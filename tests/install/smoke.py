"""Import-and-call smoke test of an installed moekit package (run by tests/install/pip_from_archive).

One sharded ragged_dot under jit and its gradients, against jax.lax.ragged_dot on the rows of the
local groups; exits non-zero on any difference. Usage: python smoke.py --expect-cuda 0|1
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import moekit.jax as mj

parser = argparse.ArgumentParser()
parser.add_argument("--expect-cuda", type=int, choices=(0, 1), required=True)
args = parser.parse_args()
assert mj.cuda_built() == bool(args.expect_cuda), f"cuda_built() = {mj.cuda_built()}"

# Four experts of which this shard holds 1 and 2; 19 rows, 2 of them past sum(sizes). Every
# value is a multiple of 1/4 in [-1, 1] and K is small, so every sum is exact in f32.
rng = np.random.default_rng(0)
sizes = jnp.array([5, 4, 0, 8], jnp.int32)
lhs = jnp.asarray(rng.integers(-4, 5, (19, 6)) / 4, jnp.float32)
w = jnp.asarray(rng.integers(-4, 5, (4, 6, 3)) / 4, jnp.float32)
first, e_loc = 1, 2
rows = np.repeat(np.arange(5), np.append(np.asarray(sizes), 19 - int(sizes.sum())))
local = jnp.asarray((rows >= first) & (rows < first + e_loc))[:, None]


def moekit_loss(lhs, w_loc):
    return jnp.sum(mj.ragged_dot(lhs, w_loc, sizes, group_offset=first) ** 2)


def jax_loss(lhs, w_loc):  # the same with every expert's weights, the non-local ones zero
    w_all = jnp.zeros_like(w).at[first:first + e_loc].set(w_loc)
    return jnp.sum(jnp.where(local, jax.lax.ragged_dot(lhs, w_all, sizes), 0) ** 2)


w_loc = w[first:first + e_loc]
got = jax.jit(jax.value_and_grad(moekit_loss, argnums=(0, 1)))(lhs, w_loc)
want = jax.value_and_grad(jax_loss, argnums=(0, 1))(lhs, w_loc)
for name, g, r in zip(("loss", "d_lhs", "d_rhs"), jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(r), err_msg=name)
print(f"moekit smoke test: ragged_dot with group_offset and its gradients equal jax.lax.ragged_dot "
      f"(jax {jax.__version__}, cuda_built={mj.cuda_built()})")
