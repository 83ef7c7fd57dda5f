"""Expert parallelism with group_offset: an MoE layer on 4 CPU devices.

Each device holds E/4 of the experts' weights and runs the layer on every token, but its two
grouped matmuls compute only the rows routed to its own experts (`group_offset` = its first
expert); every other row comes out exactly 0 without being computed. `psum` over the devices adds
the four partial outputs into the layer's output. The script checks the sharded layer, and its
gradients, against the same layer on one device, and prints how far apart they are.

Run:  python examples/expert_parallel.py      (sets XLA_FLAGS for 4 CPU devices itself)
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import moekit.jax as mj  # noqa: E402

T, H, F, E, K, DEVICES = 96, 32, 48, 8, 2, 4


def moe_layer(x, w_router, w_up, w_down, group_offset=None):
    """x [T, H] -> [T, H]: route, permute, up, GELU, down, unpermute. With group_offset, w_up and
    w_down hold only the experts group_offset .. group_offset + E_loc - 1, and only their rows
    are computed (the others are 0)."""
    r = mj.route(x @ w_router, K)
    p = mj.permute(x, r.topk_indices, num_experts=E)
    h = jax.nn.gelu(mj.ragged_dot(p.x, w_up, p.tokens_per_expert, group_offset))
    y = mj.ragged_dot(h, w_down, p.tokens_per_expert, group_offset)
    return mj.unpermute(y, p, r.topk_weights)


def sharded_layer(mesh):
    e_loc = E // DEVICES

    def per_device(x, w_router, w_up, w_down):
        first = jax.lax.axis_index("ep") * e_loc  # this device's first expert (traced)
        return jax.lax.psum(moe_layer(x, w_router, w_up, w_down, first), "ep")

    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P("ep"), P("ep")),
                         out_specs=P())


def main():
    assert len(jax.devices()) >= DEVICES, f"needs {DEVICES} devices, has {jax.devices()}"
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("ep",))
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (T, H))
    w_router = jax.random.normal(keys[1], (H, E)) / H**0.5
    w_up = jax.random.normal(keys[2], (E, H, F)) / H**0.5
    w_down = jax.random.normal(keys[3], (E, F, H)) / F**0.5
    params = (w_router, w_up, w_down)

    def loss(layer):
        return lambda x, *params: jnp.sum(layer(x, *params) ** 2)

    one = jax.jit(moe_layer)
    four = jax.jit(sharded_layer(mesh))
    want, got = one(x, *params), four(x, *params)
    grads_want = jax.jit(jax.grad(loss(moe_layer), argnums=(0, 1, 2, 3)))(x, *params)
    grads_got = jax.jit(jax.grad(loss(sharded_layer(mesh)), argnums=(0, 1, 2, 3)))(x, *params)

    print(f"MoE layer: T={T} H={H} F={F} E={E} k={K}, experts sharded over {DEVICES} devices")
    print(f"  output       max |sharded - one device| = {float(jnp.abs(got - want).max()):.2e}")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for name, g, w in zip(("x", "w_router", "w_up", "w_down"), grads_got, grads_want):
        print(f"  d{name:<11} max |sharded - one device| = {float(jnp.abs(g - w).max()):.2e}")
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    print("sharded layer equals the one-device layer, values and gradients")


if __name__ == "__main__":
    main()
