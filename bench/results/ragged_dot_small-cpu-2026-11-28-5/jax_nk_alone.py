"""moekit.jax.ragged_dot_general on [E, n, K] weights alone: qwen3-30b-a3b's shapes (K = 2048,
n = 768, 128 experts, top-8), bf16, equal groups; each call's ms, 8 calls, the first included.

    .venv/bin/python bench/results/ragged_dot_small-cpu-2026-11-28-5/jax_nk_alone.py
"""
import time

import jax
import jax.numpy as jnp
import numpy as np

import moekit.jax as mj

E, H, F, k = 128, 2048, 768, 8
dn = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                       lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
rng = np.random.default_rng(0)
w = jnp.asarray(rng.standard_normal((E, F, H)) / np.sqrt(H), jnp.bfloat16)  # [E, n, K]
for T in (64, 1024):
    m = T * k
    x = jnp.asarray(rng.standard_normal((m, H)), jnp.bfloat16)
    s = jnp.asarray(np.full(E, m // E), jnp.int32)
    f = jax.jit(lambda x, w, s: mj.ragged_dot_general(x, w, s, dn)).lower(x, w, s).compile()
    ts = []
    for _ in range(8):
        t = time.perf_counter()
        jax.block_until_ready(f(x, w, s))
        ts.append(round(1e3 * (time.perf_counter() - t), 1))
    print(T, ts)
