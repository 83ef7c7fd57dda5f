"""Expert parallelism: an MoE layer on 4 CPU devices, two ways, each checked against one device.

Replicated tokens: every device holds every token and E/4 of the experts' weights, and runs the
whole layer, but its two grouped matmuls compute only the rows routed to its own experts
(`group_offset` = its first expert); every other row comes out exactly 0 without being computed.
`psum` adds the four partial outputs. Simple, but every device routes and permutes the whole
batch and holds all of its activations: it does not scale past one device's batch.

Sharded tokens: every device holds a quarter of the tokens and E/4 of the experts.
`moe_layer(..., ep_axis="ep")` routes and permutes a device's own tokens, sends each expert's rows
to the device holding it (an all_to_all), computes its experts' rows, and sends the results back.

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


def one_device(x, params):
    """The reference: x [T, H] -> [T, H] on one device (route, permute, up, GELU, down,
    unpermute)."""
    return mj.moe_layer(x, params, k=K, activation_kind="gelu")[0]


def replicated(mesh):
    """Every device all tokens; its experts' rows only (group_offset); psum of the parts."""
    e_loc = E // DEVICES

    def per_device(x, params):
        first = jax.lax.axis_index("ep") * e_loc  # this device's first expert (traced)
        r = mj.route(x @ params.router, K)
        p = mj.permute(x, r.topk_indices, num_experts=E)
        h = jax.nn.gelu(mj.ragged_dot(p.x, params.w_in, p.tokens_per_expert, group_offset=first))
        y = mj.ragged_dot(h, params.w_out, p.tokens_per_expert, group_offset=first)
        return jax.lax.psum(mj.unpermute(y, p, r.topk_weights), "ep")

    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(), mj.MoeParams(P(), P("ep"),
                                                                             P("ep"))),
                         out_specs=P())


def sharded(mesh):
    """Every device a quarter of the tokens; rows travel to their experts' devices and back."""
    def per_device(x, params):
        return mj.moe_layer(x, params, k=K, activation_kind="gelu", ep_axis="ep")[0]

    return jax.shard_map(per_device, mesh=mesh,
                         in_specs=(P("ep"), mj.MoeParams(P(), P("ep"), P("ep"))),
                         out_specs=P("ep"))


def main():
    assert len(jax.devices()) >= DEVICES, f"needs {DEVICES} devices, has {jax.devices()}"
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("ep",))
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (T, H))
    params = mj.MoeParams(jax.random.normal(keys[1], (H, E)) / H**0.5,
                          jax.random.normal(keys[2], (E, H, F)) / H**0.5,
                          jax.random.normal(keys[3], (E, F, H)) / F**0.5)

    def loss(layer):
        return lambda x, params: jnp.sum(layer(x, params) ** 2)

    want = jax.jit(one_device)(x, params)
    grads_want = jax.jit(jax.grad(loss(one_device), argnums=(0, 1)))(x, params)
    print(f"MoE layer: T={T} H={H} F={F} E={E} k={K}, experts sharded over {DEVICES} devices")
    for name, layer in (("replicated tokens", replicated(mesh)),
                        ("sharded tokens", sharded(mesh))):
        got = jax.jit(layer)(x, params)
        grads = jax.jit(jax.grad(loss(layer), argnums=(0, 1)))(x, params)
        print(f"  {name}: output max |diff| = {float(jnp.abs(got - want).max()):.2e}", end="")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        worst = 0.0
        for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_want)):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
            worst = max(worst, float(jnp.abs(g - w).max()))
        print(f", gradients (x and every weight) max |diff| = {worst:.2e}")
    print("both forms equal the one-device layer, values and gradients")


if __name__ == "__main__":
    main()
