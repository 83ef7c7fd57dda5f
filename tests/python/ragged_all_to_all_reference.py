"""`jax.lax.ragged_all_to_all` as its docstring defines it, built from `all_to_all`, a gather and
a scatter, for testing moekit's ragged exchange (`moekit.jax.ep.dispatch_ragged`) on XLA:CPU,
whose compiler does not lower the primitive. The ep tests put it in place of jax's before
tracing. Differentiable (JAX differentiates the pieces); a chunk reaching outside `operand` or
`output` makes the whole result NaN, where the primitive's behaviour is undefined."""

import jax
import jax.numpy as jnp


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                      axis_name, axis_index_groups=None):
    assert axis_index_groups is None, "not emulated"
    K, N, M = input_offsets.shape[0], operand.shape[0], output.shape[0]
    row = jnp.arange(N, dtype=jnp.int32)[None, :]  # a chunk has at most N rows
    # Chunk i (for device i // (K / P)): operand rows input_offsets[i] .. + send_sizes[i].
    take = input_offsets[:, None] + row  # [K, N]
    sent = row < send_sizes[:, None]
    chunks = jnp.where(sent.reshape(K, N, *(1,) * (operand.ndim - 1)),
                       operand[jnp.clip(take, 0, N - 1)], 0)
    got = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)  # chunk i from i // (K / P)
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)[:, None] + row
    received = row < recv_sizes[:, None]
    outside = (jnp.any(sent & ((take < 0) | (take >= N)))
               | jnp.any(received & ((at < 0) | (at >= M))))
    result = output.at[jnp.where(received, at, M).reshape(-1)].set(
        got.reshape(K * N, *operand.shape[1:]), mode="drop")
    return jnp.where(outside, jnp.nan, result).astype(output.dtype)


def check_the_documented_example(mesh):
    """The example in jax.lax.ragged_all_to_all's docstring, on a 2-device mesh axis "ep"."""
    from jax.sharding import PartitionSpec as P

    args = [jnp.array(a, jnp.float32 if i < 2 else jnp.int32) for i, a in enumerate(
        ([1, 2, 2, 3, 4, 0], [0] * 8, [0, 1, 0, 1], [1, 2, 1, 1], [0, 0, 1, 2], [1, 1, 2, 1]))]
    run = jax.shard_map(lambda *a: ragged_all_to_all(*a, axis_name="ep"), mesh=mesh,
                        in_specs=P("ep"), out_specs=P("ep"))
    got = [float(v) for v in jax.jit(run)(*args)]
    assert got == [1, 3, 0, 0, 2, 2, 4, 0], got
