"""Times ragged_dot inside JAX on a model preset's shapes (bench/presets.json).

    .venv/bin/python bench/jax_ragged_dot.py --preset qwen3-30b-a3b --tokens 4096 \
        [--dtype bf16] [--shards 1,4] [--impls moekit,lax,masked] [--reps 5] [--json]

m = tokens * k routed rows, K = H, n = F, E groups whose sizes vary by a seeded +-25% (as in
`moekit bench ragged_dot`, drawn here with NumPy: same totals, not the same sizes). Each case is
jitted, run once untimed, then `--reps` times; the median is reported.

Implementations:
  moekit  moekit.jax.ragged_dot; with S shards, shard 0's call: E/S local groups and
          group_offset, so only its rows are computed.
  lax     jax.lax.ragged_dot over all groups (slow on the CPU: about 7 s per call at 256 tokens).
  masked  the workaround moekit replaces: jax.lax.ragged_dot over all groups with the
          non-local groups' weights zero, then the non-local rows masked out.
Passes: fwd, and fwd+bwd (the gradients to lhs and rhs of sum(out * w)).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import moekit.jax as mj

PRESETS = pathlib.Path(__file__).with_name("presets.json")


def group_sizes(rows, groups, imbalance, seed):
    """Sizes that vary by +-imbalance around rows/groups and sum to rows."""
    rng = np.random.default_rng(seed)
    w = 1.0 + rng.uniform(-imbalance, imbalance, groups)
    sizes = np.floor(rows * w / w.sum()).astype(np.int64)
    sizes[: rows - sizes.sum()] += 1
    return sizes.astype(np.int32)


def masked(lhs, rhs_local, sizes, offset):
    rhs = jnp.zeros((sizes.shape[0],) + rhs_local.shape[1:], rhs_local.dtype)
    rhs = jax.lax.dynamic_update_slice(rhs, rhs_local, (offset, 0, 0))
    out = jax.lax.ragged_dot(lhs, rhs, sizes)
    ends = jnp.cumsum(sizes)
    rows = jnp.arange(lhs.shape[0])
    local = (rows >= ends[offset] - sizes[offset]) & (rows < ends[offset + rhs_local.shape[0] - 1])
    return jnp.where(local[:, None], out, 0)


def impl_fn(name, sizes, offset):
    if name == "moekit":
        return lambda a, b: mj.ragged_dot(a, b, sizes, offset)
    if name == "lax":
        return lambda a, b: jax.lax.ragged_dot(a, b, sizes)
    return lambda a, b: masked(a, b, sizes, offset)


def time_ms(fn, args, reps):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(1e3 * (time.perf_counter() - t))
    return statistics.median(ts), min(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--shards", default="1,4", help="comma-separated shard counts")
    ap.add_argument("--impls", default="moekit", help="moekit,lax,masked")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--json", action="store_true", help="JSON array on stdout, table on stderr")
    a = ap.parse_args()
    preset = next((p for p in json.loads(PRESETS.read_text())["presets"]
                   if p["name"] == a.preset), None)
    if preset is None:
        ap.error(f"--preset {a.preset}: not in {PRESETS}")
    impls = a.impls.split(",")
    for i in impls:
        if i not in ("moekit", "lax", "masked"):
            ap.error(f"--impls: unknown implementation {i!r}")
    shard_counts = [int(s) for s in a.shards.split(",")]
    E, H, F, k = preset["E"], preset["H"], preset["F"], preset["k"]
    for s in shard_counts:
        if s < 1 or E % s:
            ap.error(f"--shards {s}: must divide E = {E}")
    dtype = jnp.bfloat16 if a.dtype == "bf16" else jnp.float32
    m = a.tokens * k
    rng = np.random.default_rng(a.seed)
    lhs = jnp.asarray(rng.standard_normal((m, H)), dtype)
    rhs_all = jnp.asarray(rng.standard_normal((E, H, F)) / np.sqrt(H), dtype)
    w = jnp.asarray(rng.standard_normal((m, F)), dtype)
    sizes = jnp.asarray(group_sizes(m, E, 0.25, a.seed))

    cases = [(i, s, p) for s in shard_counts for i in impls for p in ("fwd", "fwd+bwd")
             if not (i == "lax" and s > 1)]  # lax has no offset: only the full call
    out = sys.stderr if a.json else sys.stdout
    rows = []
    for n, (impl, shards, pass_) in enumerate(cases, 1):
        print(f"[{n}/{len(cases)}] {impl} {pass_} shards={shards}", file=sys.stderr, flush=True)
        e_loc = E // shards
        rhs = rhs_all[:e_loc]
        f = impl_fn(impl, sizes, jnp.int32(0))
        if pass_ == "fwd":
            fn = jax.jit(f)
        else:
            fn = jax.jit(jax.grad(lambda x, y: jnp.sum((f(x, y) * w).astype(jnp.float32)),
                                  (0, 1)))
        med, best = time_ms(fn, (lhs, rhs), a.reps)
        rows.append(dict(impl=impl, pass_=pass_, shards=shards, preset=a.preset,
                         tokens=a.tokens, dtype=a.dtype, rows=int(sizes[:e_loc].sum()),
                         ms=med, min_ms=best))
    print(f"\njax {jax.__version__}, {a.preset} (m={m} K={H} n={F} E={E}), {a.dtype}, "
          f"median of {a.reps} after one untimed call; shards S: shard 0's call, E/S groups",
          file=out)
    print(f"{'impl':>7} {'pass':>8} {'shards':>6} {'rows':>7} {'ms':>10} {'min ms':>10}", file=out)
    for r in rows:
        print(f"{r['impl']:>7} {r['pass_']:>8} {r['shards']:>6} {r['rows']:>7} {r['ms']:>10.2f} "
              f"{r['min_ms']:>10.2f}", file=out)
    if a.json:
        print(json.dumps([{("pass" if k == "pass_" else k): v for k, v in r.items()}
                          for r in rows], indent=1))


if __name__ == "__main__":
    main()
