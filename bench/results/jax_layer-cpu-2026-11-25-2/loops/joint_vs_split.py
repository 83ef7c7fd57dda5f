"""The fused forward + backward as one jitted value_and_grad ("joint") against a jitted forward
(jax.vjp) and a jitted backward taking its residual ("split"), alternating, 6 calls each (the
first compiles). From the repository's root:

    .venv/bin/python bench/results/jax_layer-cpu-2026-11-25-2/loops/joint_vs_split.py
"""
import argparse
import sys
import time

sys.path.insert(0, "bench")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax_layer  # noqa: E402
import moekit.jax as mj  # noqa: E402

p, x, params, fns = jax_layer.setup(argparse.Namespace(preset="qwen3-30b-a3b", tokens=4096,
                                                       dtype="bf16", seed=0))
kw = jax_layer.routing_kw(p)
ct = jax.random.normal(jax.random.key(1), x.shape).astype(x.dtype)


def layer(x, params):
    out, aux = mj.moe_layer(x, params, aux_loss_coeff=0.01, **kw)
    return out, aux.aux_loss


fwd = jax.jit(lambda x, p: jax.vjp(layer, x, p))
bwd = jax.jit(lambda vjp, ct: vjp(ct))


def split(x, params):
    _, vjp = jax.block_until_ready(fwd(x, params))
    return bwd(vjp, (ct, jnp.ones((), jnp.float32)))


ms = {"joint": [], "split": []}
for _ in range(6):
    for name, fn in (("joint", fns["moekit"]["fwd+bwd"]), ("split", split)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x, params))
        ms[name].append(round(1e3 * (time.perf_counter() - t0)))
print(ms)
