"""The expert-parallel moe_layer (ep_axis, under shard_map) against moe_layer on one device, run
by test_layer_ep.py in a fresh process per device count (XLA_FLAGS must be set before jax
starts). Usage: python ep_layer_cases.py DEVICES  -- prints one line per case, exits 1 on any
mismatch. Then the same on the experts' weights packed with their transposes (frozen experts).

Each case runs with both of XLA's exchanges: ep_exchange="all_to_all", and "ragged" with
jax.lax.ragged_all_to_all replaced by ragged_all_to_all_reference's (XLA:CPU does not lower the
primitive; the reference is checked against the primitive's documented example first).

Dropless, the sharded layer's outputs, losses, tokens_per_expert and gradients (to x and every
weight) must equal the one-device layer's on the same tokens within f32 rounding (bf16: within
one bf16 rounding); with a capacity each device drops its own tokens, so the reference is the
one-device layer run on each device's tokens alone.
"""

import os
import sys

DEVICES = int(sys.argv[1]) if len(sys.argv) > 1 else 2
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import moekit.jax as mj  # noqa: E402
from ep_problem import (cases, compare, frozen, grad_names, layer_kwargs, loss,  # noqa
                        packed, param_specs, problem, reference, trained_grads,  # noqa
                        trained_names)  # noqa: E402
import ragged_all_to_all_reference  # noqa: E402

jax.lax.ragged_all_to_all = ragged_all_to_all_reference.ragged_all_to_all

def run_case(name, case, dtype, exchange):
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("ep",))
    x, params, ct = problem(case, dtype, DEVICES)
    kw = layer_kwargs(case)
    spec = param_specs(params)

    def sharded(x, params):
        return jax.shard_map(
            lambda x, p: mj.moe_layer(x, p, ep_axis="ep", ep_exchange=exchange, **kw), mesh=mesh,
            in_specs=(P("ep"), spec), out_specs=(P("ep"), P()))(x, params)

    one = reference(case, DEVICES)
    got = jax.jit(sharded)(x, params)
    want = jax.jit(one)(x, params)
    g_got = jax.jit(jax.grad(loss(sharded, ct), argnums=(0, 1)))(x, params)
    g_want = jax.jit(jax.grad(loss(one, ct), argnums=(0, 1)))(x, params)
    np_tree = lambda t: jax.tree.map(np.asarray, t)  # noqa: E731
    how = compare(name, case, dtype, (*np_tree(got), jax.tree.leaves(np_tree(g_got))),
                  (*np_tree(want), jax.tree.leaves(np_tree(g_want))), grad_names(params))
    print(f"ok {name} {np.dtype(dtype).name} on {DEVICES} devices ({exchange}): {how}")


def run_packed_case(name, case, dtype, exchange):
    """The experts' weights packed with their transposes (pack_ragged_rhs(...,
    input_gradient=True): frozen experts), each device its own experts': the sharded layer's
    output, losses and gradients to x, the router and the shared expert against the one-device
    layer on the same weights unpacked (its experts' gradients left out)."""
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("ep",))
    x, params, ct = problem(case, dtype, DEVICES)
    kw = layer_kwargs(case)

    def sharded(x, params):
        return jax.shard_map(
            lambda x, p: mj.moe_layer(x, p, ep_axis="ep", ep_exchange=exchange, **kw), mesh=mesh,
            in_specs=(P("ep"), param_specs(params)), out_specs=(P("ep"), P()))(x, frozen(params))

    one = reference(case, DEVICES)
    trained = trained_names(params)
    packed_params = packed(params)
    got = jax.jit(sharded)(x, packed_params)
    want = jax.jit(one)(x, params)
    g_got = jax.jit(jax.grad(loss(sharded, ct), argnums=(0, 1)))(x, packed_params)
    g_want = jax.jit(jax.grad(loss(one, ct), argnums=(0, 1)))(x, params)
    np_tree = lambda t: jax.tree.map(np.asarray, t)  # noqa: E731
    how = compare(name, case, dtype, (*np_tree(got), np_tree(trained_grads(g_got, trained))),
                  (*np_tree(want), np_tree(trained_grads(g_want, trained))), trained)
    print(f"ok packed {name} {np.dtype(dtype).name} on {DEVICES} devices ({exchange}): {how}")


def check_errors():
    """Bad sharding is a ValueError at trace time that names it."""
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("ep",))
    x, params, _ = problem(dict(H=16, F=8, E=2 * DEVICES), jnp.float32, DEVICES)
    spec = mj.MoeParams(P(), P("ep"), P("ep"))

    def call(x, params, in_specs=(P("ep"), spec)):
        return jax.shard_map(lambda x, p: mj.moe_layer(x, p, k=2, ep_axis="ep")[0], mesh=mesh,
                             in_specs=in_specs, out_specs=P("ep"))(x, params)

    wanted = {
        # Every device given all the experts' weights: E_loc would be E.
        "params.w_out must be [E_loc, F, H]":
            lambda: call(x, params, (P("ep"), mj.MoeParams(P(), P(), P()))),
        "ep_exchange = 'nccl'": lambda: jax.shard_map(
            lambda x, p: mj.moe_layer(x, p, k=2, ep_axis="ep", ep_exchange="nccl")[0],
            mesh=mesh, in_specs=(P("ep"), spec), out_specs=P("ep"))(x, params),
        # E + 1 experts cannot divide over the devices.
        "do not divide over the": lambda: call(x, params._replace(
            router=jnp.zeros((16, 2 * DEVICES + 1)))),
    }
    for what, fn in wanted.items():
        try:
            jax.eval_shape(fn)
        except ValueError as e:
            assert what in str(e), f"expected {what!r} in: {e}"
            print(f"ok error: {e}")
            continue
        raise AssertionError(f"no ValueError naming {what!r}")


def main():
    assert len(jax.devices()) == DEVICES, jax.devices()
    failed = 0
    for what, check in (("errors", check_errors), ("the ragged_all_to_all reference", lambda:
                        ragged_all_to_all_reference.check_the_documented_example(
                            Mesh(np.array(jax.devices()[:2]), ("ep",))))):
        try:
            check()
        except AssertionError as e:
            failed += 1
            print(f"FAILED {what}: {e}")
    for exchange in ("all_to_all", "ragged"):
        for dtype in (jnp.float32, jnp.bfloat16):
            for name, case in cases(DEVICES).items():
                try:
                    run_case(name, case, dtype, exchange)
                except AssertionError as e:
                    failed += 1
                    print(f"FAILED {name} {np.dtype(dtype).name} on {DEVICES} devices "
                          f"({exchange}): {e}")
    for exchange in ("all_to_all", "ragged"):
        for dtype in (jnp.float32, jnp.bfloat16):
            for name in ("uneven_routing", "shared_expert_geglu"):
                try:
                    run_packed_case(name, cases(DEVICES)[name], dtype, exchange)
                except AssertionError as e:
                    failed += 1
                    print(f"FAILED packed {name} {np.dtype(dtype).name} on {DEVICES} devices "
                          f"({exchange}): {e}")
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
