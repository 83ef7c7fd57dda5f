"""moekit.jax.ragged_dot_general on [E, n, K] weights (a linear layer's [out, in] per expert),
read as they lie, against what it did before: the weights transposed to [E, K, n] by XLA (a copy
every call), then the [E, K, n] kernels. Both in one process on qwen3-30b-a3b's shapes (K = H
2048, n = F 768, 128 experts, top-8), bf16: each round times `--reps` calls of one form, then of
the other (in blocks: alternated call by call, the copy's 403 MB of writes slowed the other
form's next call by half).

    .venv/bin/python bench/results/ragged_dot_small-cpu-2026-11-28-5/jax_layout_ab.py \
        [--tokens 64,512,1024,4096] [--reps 5] [--rounds 2]
"""
import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import moekit.jax as mj

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", default="64,512,1024,4096")
ap.add_argument("--reps", type=int, default=5)
ap.add_argument("--rounds", type=int, default=2)
a = ap.parse_args()
E, H, F, k = 128, 2048, 768, 8
dn = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                       lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
rng = np.random.default_rng(0)
w_nk = jnp.asarray(rng.standard_normal((E, F, H)) / np.sqrt(H), jnp.bfloat16)  # [E, n, K]
impls = {
    "as it lies": lambda x, w, s: mj.ragged_dot_general(x, w, s, dn),
    "copied to [E,K,n]": lambda x, w, s: mj.ragged_dot(x, jnp.swapaxes(w, 1, 2), s),
}
print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; ms: median of {a.reps} calls "
      f"after 1 untimed, one form's block of calls then the other's, {a.rounds} rounds")
for T in [int(t) for t in a.tokens.split(",")]:
    m = T * k
    x = jnp.asarray(rng.standard_normal((m, H)), jnp.bfloat16)
    ct = jnp.asarray(rng.standard_normal((m, F)), jnp.bfloat16)
    w_ = 1.0 + rng.uniform(-0.25, 0.25, E)
    sizes = np.floor(m * w_ / w_.sum()).astype(np.int64)
    sizes[: m - sizes.sum()] += 1
    s = jnp.asarray(sizes, jnp.int32)
    fns = {}
    for name, f in impls.items():
        fwd = jax.jit(f).lower(x, w_nk, s).compile()
        loss = lambda x, w, f=f: jnp.sum((f(x, w, s) * ct).astype(jnp.float32))
        both = jax.jit(jax.grad(loss, (0, 1))).lower(x, w_nk).compile()
        fns[name] = (fwd, both)
    got = [np.float32(fns[n][0](x, w_nk, s)) for n in impls]
    assert np.allclose(got[0], got[1], rtol=2e-2, atol=2e-2), "the two forms differ"
    for r in range(a.rounds):
        for p, pname in enumerate(("fwd", "fwd+bwd")):
            ts = {n: [] for n in impls}
            args = (x, w_nk, s) if p == 0 else (x, w_nk)
            for n in impls:
                for rep in range(a.reps + 1):
                    t = time.perf_counter()
                    jax.block_until_ready(fns[n][p](*args))
                    if rep:
                        ts[n].append(1e3 * (time.perf_counter() - t))
            med = {n: statistics.median(v) for n, v in ts.items()}
            names = list(impls)
            print(f"T={T:5d} round {r + 1} {pname:>8}: " +
                  "  ".join(f"{n} {med[n]:8.2f} ms" for n in names) +
                  f"  copied / as it lies {med[names[1]] / med[names[0]]:.2f}x", flush=True)
