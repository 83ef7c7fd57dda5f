"""moe_layer on expert weights stored [E, out, in] (qwen3-30b-a3b's shapes, bf16): read as they lie
(expert_weights_transposed=True) against what a caller had to do before, swapaxes to [E, in, out]
inside the jitted step (XLA copies every expert weight each call, and transposes the gradient
back). Both in one process, in blocks of 5 calls, two rounds; ms per call (median of a block).

Usage: .venv/bin/python bench/results/layer_weight_layout-cpu-2026-11-28/jax_layout_ab.py
"""
import statistics
import time

import jax
import jax.numpy as jnp

import moekit.jax as mj

H, F, E, K = 2048, 768, 128, 8
BF16 = jnp.bfloat16


def timed(fn, *args):
    jax.block_until_ready(fn(*args))
    t = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        t.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(t)


def main():
    keys = jax.random.split(jax.random.key(0), 4)
    router = (jax.random.normal(keys[0], (H, E)) / 45).astype(BF16)
    w_in_t = (jax.random.normal(keys[1], (E, 2 * F, H)) / 45).astype(BF16)  # [E, out, in]
    w_out_t = (jax.random.normal(keys[2], (E, H, F)) / 28).astype(BF16)
    params_t = mj.MoeParams(router, w_in_t, w_out_t)

    def as_they_lie(x, p):
        return mj.moe_layer(x, p, k=K, expert_weights_transposed=True)[0]

    def swapped_first(x, p):
        p = p._replace(w_in=jnp.swapaxes(p.w_in, 1, 2), w_out=jnp.swapaxes(p.w_out, 1, 2))
        return mj.moe_layer(x, p, k=K)[0]

    def with_grads(layer):
        return jax.jit(jax.grad(lambda x, p: jnp.sum(layer(x, p).astype(jnp.float32)),
                                argnums=(0, 1)))

    forms = {"fwd as they lie": jax.jit(as_they_lie), "fwd swapped first": jax.jit(swapped_first),
             "fwd+bwd as they lie": with_grads(as_they_lie),
             "fwd+bwd swapped first": with_grads(swapped_first)}
    print(f"{jax.devices()[0].device_kind}; qwen3-30b-a3b shapes, bf16, weights [E, out, in]")
    for T in (64, 1024):
        x = jax.random.normal(keys[3], (T, H)).astype(BF16)
        for rnd in (1, 2):
            row = {name: timed(fn, x, params_t) for name, fn in forms.items()}
            print(f"T={T} round {rnd}: " + ", ".join(f"{n} {ms:.1f} ms" for n, ms in row.items()),
                  flush=True)


if __name__ == "__main__":
    main()
