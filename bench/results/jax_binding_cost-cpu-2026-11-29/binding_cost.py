"""What one call through moekit.jax costs beside the work it asks for: the time per call of
jitted functions whose work is ~nothing, in one process, alternating, so that the host's
memory-rate drift (which moves the presets' 1-8 token layers by 2-3x between processes) is not
in it. Each line: the median over --rounds of a round's mean per call (--calls calls issued and
each waited for, as a decode loop does).

  jnp        x + 1 on a [1, 64] array: JAX's own dispatch of a jitted call
  ragged     moekit.jax.ragged_dot, 1 row, [8, 64, 64] packed weights: one FFI call
  layer      moekit.jax.moe_layer, 1 / 8 tokens, H 64, F 32, E 8, k 2, packed weights: the
             fused C++ layer's forward, one FFI call
  layer-unp  the same on the weights unpacked

    .venv/bin/python bench/results/jax_binding_cost-cpu-2026-11-29/binding_cost.py
"""
import argparse
import statistics
import time

import jax
import moekit.jax as mj  # noqa: F401 (before the first computation: its malloc settings)
import jax.numpy as jnp
import numpy as np


def per_call_us(f, args, calls):
    out = f(*args)
    jax.block_until_ready(out)
    t = time.perf_counter()
    for _ in range(calls):
        jax.block_until_ready(f(*args))
    return 1e6 * (time.perf_counter() - t) / calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    a = ap.parse_args()
    dt = jnp.bfloat16 if a.dtype == "bf16" else jnp.float32
    rng = np.random.default_rng(0)
    H, F, E, k = 64, 32, 8, 2
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-2]), dt)
    p = mj.MoeParams(w(H, E), w(E, H, 2 * F), w(E, F, H), None, None)
    packed = p._replace(w_in=mj.pack_ragged_rhs(p.w_in), w_out=mj.pack_ragged_rhs(p.w_out))
    rhs = mj.pack_ragged_rhs(w(8, 64, 64))
    gs = jnp.asarray([1] + [0] * 7, jnp.int32)
    layer = jax.jit(lambda x, p: mj.moe_layer(x, p, k=k)[0])
    cases = {
        "jnp": (jax.jit(lambda x: x + 1), (jnp.ones((1, 64), dt),)),
        "ragged": (jax.jit(lambda x, r: mj.ragged_dot(x, r, gs)), (jnp.ones((1, 64), dt), rhs)),
    }
    for T in (1, 8):
        x = jnp.asarray(rng.standard_normal((T, H)), dt)
        cases[f"layer T={T}"] = (layer, (x, packed))
        cases[f"layer-unp T={T}"] = (layer, (x, p))
    times = {name: [] for name in cases}
    for r in range(a.rounds):
        for name, (f, args) in cases.items():
            times[name].append(per_call_us(f, args, a.calls))
        print(f"round {r + 1}/{a.rounds}", flush=True)
    print(f"jax {jax.__version__}, {a.dtype}, {a.calls} calls a round, median of {a.rounds} "
          f"rounds (min-max of the rounds), us per call")
    for name, ts in times.items():
        print(f"{name:16s} {statistics.median(ts):8.1f}   ({min(ts):.1f}-{max(ts):.1f})")


if __name__ == "__main__":
    main()
