"""Frozen experts on the CPU: moekit.jax.moe_layer's gradients to x and the router (the experts'
weights closed over, taking none) on a preset's shapes, three ways in one process, alternating:

  packed   the experts packed with their transposes (pack_ragged_rhs(..., input_gradient=True)),
           fused=False: the steps, ragged_dot and its input gradient on the packed weights
  steps    the same weights unpacked, fused=False: the steps on kAuto (the weight gradients not
           asked for, so not computed)
  fused    the same weights unpacked, the fused C++ layer (its backward computes every gradient,
           the experts' included, and the unwanted ones are dropped)
  default  (--with-default, added 2026-11-30) the packed weights as packed, fused left to
           moe_layer: the fused forward, handing differentiation to the steps

Each line: the median over --rounds of a round's median of --reps calls of the jitted
value_and_grad, ms, and the ratios. The forward alone (jitted moe_layer) beside it.

    .venv/bin/python bench/results/jax_frozen_experts-cpu-2026-11-29/frozen.py \\
        --preset qwen3-30b-a3b --tokens 8,32,64
"""
import argparse
import json
import pathlib
import statistics
import time

import jax
import moekit.jax as mj  # noqa: F401 (before the first computation: its malloc settings)
import jax.numpy as jnp
import numpy as np

PRESETS = pathlib.Path(__file__).resolve().parents[2] / "presets.json"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", default="8,32,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--with-default", action="store_true")
    a = ap.parse_args()
    p = next(q for q in json.loads(PRESETS.read_text())["presets"] if q["name"] == a.preset)
    H, F, E, k = p["H"], p["F"], p["E"], p["k"]
    kw = dict(k=k, score=p["score"], pre_softmax=p["pre_softmax"], aux_loss_coeff=0.01)
    if p.get("num_groups"):
        kw.update(num_groups=p["num_groups"], group_topk=p["group_topk"])
    dt = jnp.bfloat16
    key = jax.random.split(jax.random.key(0), 5)
    w_in = (jax.random.normal(key[1], (E, H, 2 * F)) * H ** -0.5).astype(dt)
    w_out = (jax.random.normal(key[2], (E, F, H)) * F ** -0.5).astype(dt)
    router = (jax.random.normal(key[0], (H, E)) * H ** -0.5).astype(dt)
    p_in, p_out = (mj.pack_ragged_rhs(w, input_gradient=True) for w in (w_in, w_out))
    jax.block_until_ready((p_in.data, p_in.data_t, p_out.data, p_out.data_t))

    def make(wi, wo, fused):
        # The experts' weights are arguments of the jitted calls (closed over, XLA would embed
        # them as constants), differentiated or not as argnums says: not.
        def f(x, r, ct, wi, wo):
            out, aux = mj.moe_layer(x, mj.MoeParams(r, wi, wo), fused=fused, **kw)
            return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)) + aux.aux_loss
        grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
        fwd = jax.jit(lambda x, r, wi, wo: mj.moe_layer(x, mj.MoeParams(r, wi, wo), fused=fused,
                                                        **kw)[0])
        return (lambda x, r, ct: grad(x, r, ct, wi, wo), lambda x, r: fwd(x, r, wi, wo))

    ways = {"packed": make(p_in, p_out, False), "steps": make(w_in, w_out, False),
            "fused": make(w_in, w_out, True)}
    if a.with_default:
        ways["default"] = make(p_in, p_out, None)
    print(f"{a.preset} bf16, H {H} F {F} E {E} k {k}, jax {jax.__version__}; ms, median of "
          f"{a.rounds} rounds of {a.reps}", flush=True)
    print(f"{'tokens':>6} {'pass':>9} " + " ".join(f"{w:>8}" for w in ways) +
          "  packed/steps packed/fused")
    for T in (int(t) for t in a.tokens.split(",")):
        x = jax.random.normal(key[3], (T, H)).astype(dt)
        ct = jax.random.normal(key[4], (T, H)).astype(dt)
        for ps, pick in (("grad", 0), ("forward", 1)):
            args = (x, router, ct) if pick == 0 else (x, router)
            for fns in ways.values():
                jax.block_until_ready(fns[pick](*args))  # compile, warm
            rounds = {w: [] for w in ways}
            for _ in range(a.rounds):
                for w, fns in ways.items():
                    ts = []
                    for _ in range(a.reps):
                        t = time.perf_counter()
                        jax.block_until_ready(fns[pick](*args))
                        ts.append(1e3 * (time.perf_counter() - t))
                    rounds[w].append(statistics.median(ts))
            ms = {w: statistics.median(v) for w, v in rounds.items()}
            print(f"{T:>6} {ps:>9} " + " ".join(f"{ms[w]:8.2f}" for w in ways) +
                  f"  {ms['steps'] / ms['packed']:11.2f}x {ms['fused'] / ms['packed']:11.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
