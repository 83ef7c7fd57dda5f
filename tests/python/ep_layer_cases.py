"""The expert-parallel moe_layer (ep_axis, under shard_map) against moe_layer on one device, run
by test_layer_ep.py in a fresh process per device count (XLA_FLAGS must be set before jax
starts). Usage: python ep_layer_cases.py DEVICES  -- prints one line per case, exits 1 on any
mismatch.

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
from ep_problem import T_LOC, cases, layer_kwargs, problem  # noqa: E402

def run_case(name, case, dtype):
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("ep",))
    x, params, ct = problem(case, dtype, DEVICES)
    kw = layer_kwargs(case)
    shared = params.shared_in is not None
    spec = mj.MoeParams(P(), P("ep"), P("ep"), P() if shared else None, P() if shared else None)

    def sharded(x, params):
        return jax.shard_map(lambda x, p: mj.moe_layer(x, p, ep_axis="ep", **kw), mesh=mesh,
                             in_specs=(P("ep"), spec), out_specs=(P("ep"), P()))(x, params)

    def one(x, params):
        if "capacity_factor" not in case:
            return mj.moe_layer(x, params, **kw)
        # Each device drops its own tokens: the one-device layer on each device's tokens alone.
        outs = [mj.moe_layer(x[d * T_LOC:(d + 1) * T_LOC], params, **kw) for d in range(DEVICES)]
        out = jnp.concatenate([o for o, _ in outs])
        return out, mj.MoeAux(sum(a.aux_loss for _, a in outs), sum(a.z_loss for _, a in outs),
                              sum(a.tokens_per_expert for _, a in outs))

    def loss(f):
        def value(x, params):
            out, aux = f(x, params)
            return (jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)) + aux.aux_loss
                    + aux.z_loss)
        return value

    got, got_aux = jax.jit(sharded)(x, params)
    want, want_aux = jax.jit(one)(x, params)
    g_got = jax.jit(jax.grad(loss(sharded), argnums=(0, 1)))(x, params)
    g_want = jax.jit(jax.grad(loss(one), argnums=(0, 1)))(x, params)

    tol = dict(rtol=2e-5, atol=2e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    np.testing.assert_allclose(f32(got), f32(want), **tol, err_msg=f"{name}: out")
    np.testing.assert_array_equal(got_aux.tokens_per_expert, want_aux.tokens_per_expert,
                                  err_msg=f"{name}: tokens_per_expert")
    if "capacity_factor" not in case:  # per-device references have per-device losses
        np.testing.assert_allclose(f32(got_aux.aux_loss), f32(want_aux.aux_loss), rtol=1e-5,
                                   atol=1e-7, err_msg=f"{name}: aux_loss")
        np.testing.assert_allclose(f32(got_aux.z_loss), f32(want_aux.z_loss), rtol=1e-5,
                                   atol=1e-7, err_msg=f"{name}: z_loss")
    names = ["d_x", "d_router", "d_w_in", "d_w_out", "d_shared_in", "d_shared_out"]
    worst = []
    for n, g, w in zip(names, jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
        scale = float(np.abs(f32(w)).max()) or 1.0
        np.testing.assert_allclose(f32(g), f32(w), rtol=tol["rtol"], atol=tol["atol"] * scale,
                                   err_msg=f"{name}: {n}")
        worst.append(f"{n} {float(np.abs(f32(g) - f32(w)).max()):.1e}")
    exact = float(np.abs(f32(got) - f32(want)).max()) == 0.0
    print(f"ok {name} {np.dtype(dtype).name} on {DEVICES} devices: out "
          f"{'bit-exact' if exact else 'within tolerance'}; max |diff| {', '.join(worst)}")


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
    try:
        check_errors()
    except AssertionError as e:
        failed += 1
        print(f"FAILED errors: {e}")
    for dtype in (jnp.float32, jnp.bfloat16):
        for name, case in cases(DEVICES).items():
            try:
                run_case(name, case, dtype)
            except AssertionError as e:
                failed += 1
                print(f"FAILED {name} {np.dtype(dtype).name} on {DEVICES} devices: {e}")
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
