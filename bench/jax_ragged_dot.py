"""Times ragged_dot inside JAX on a model preset's shapes (bench/presets.json).

    .venv/bin/python bench/jax_ragged_dot.py --preset qwen3-30b-a3b --tokens 4096 \
        [--dtype bf16] [--shards 1,4] [--impls moekit,lax,masked] [--passes fwd,fwd+bwd] \
        [--reps 5] [--warmup 1] [--inner N] [--rhs-layout kn|nk] [--dims H,F,E,k] [--json]

It runs on JAX's default device: the CPU, or a GPU where jax has one (moekit's CUDA handlers).

m = tokens * k routed rows, K = H, n = F, E groups whose sizes vary by a seeded +-25% (as in
`moekit bench ragged_dot`, drawn here with NumPy: same totals, not the same sizes); --dims
replaces the preset's H, F, E and k (a test's small case: at qwen3-30b-a3b's sizes one run holds
11 GiB at any token count, the masked shards' zeros and gradients). Each case is compiled ahead of
time (compilation is not timed), run `--warmup` times untimed, then `--reps` times; the median
is reported. Each rep times `--inner` calls issued back to back and waited for once (default 1
on the CPU, 20 on a GPU, where one call can take less time than its dispatch).
TFLOP/s counts the useful work, 2 * rows * K * n per matmul (3 matmuls for fwd+bwd), whatever
an implementation computes beside it.

Shard counts S > 1 time two things:
  shard0  one device's call alone: E/S local groups and group_offset 0.
  spmd    all S shards at once in `jax.shard_map` over S CPU devices (the script asks XLA for
          max(S) host devices), each holding E/S experts at group_offset = its first expert,
          and the partial outputs added with `psum`: the whole expert-parallel step. The S
          devices share this machine's cores, so with moekit it should take about the full
          call's time, and with the masking workaround about S times it. On GPUs, only where
          there are S of them.

Implementations:
  moekit  moekit.jax.ragged_dot; with S shards, shard 0's call: E/S local groups and
          group_offset, so only its rows are computed.
  lax     jax.lax.ragged_dot over all groups. XLA's CPU version computes every row against
          every group's weights, E times the work: about 7 s per call at 256 tokens here.
  masked  the workaround moekit replaces: jax.lax.ragged_dot over all groups with the
          non-local groups' weights zero, then the non-local rows masked out. Only S > 1.
Passes: fwd, and fwd+bwd (the gradients to lhs and rhs of sum(out * w)).
--rhs-layout nk: the weights stored [E, n, K] (a linear layer's [out, in] per expert), which
moekit and lax take through ragged_dot_general (moekit reads them as they lie; masked transposes
them to [E, K, n] first).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time


def _host_devices(argv):
    """The most shards asked for: XLA must be told before jax is imported."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--shards", default="1,4")
    try:
        return max(int(s) for s in pre.parse_known_args(argv)[0].shards.split(","))
    except ValueError:
        return 1  # main()'s parser reports the bad value


if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={_host_devices(sys.argv[1:])}").strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import moekit.jax as mj  # noqa: E402

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


# ragged_dot_general's dimension numbers for weights [E, n, K].
_NK = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                        lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def impl_fn(name, sizes, offset, nk=False):
    """(lhs [m, K], rhs [E_loc, K, n], or [E_loc, n, K] where nk) -> [m, n] for one shard whose
    first group is offset."""
    if name == "moekit":
        if nk:
            return lambda a, b: mj.ragged_dot_general(a, b, sizes, _NK, group_offset=offset)
        return lambda a, b: mj.ragged_dot(a, b, sizes, group_offset=offset)
    if name == "lax":
        if nk:
            return lambda a, b: jax.lax.ragged_dot_general(a, b, sizes, _NK)
        return lambda a, b: jax.lax.ragged_dot(a, b, sizes)
    if nk:
        return lambda a, b: masked(a, jnp.swapaxes(b, 1, 2), sizes, offset)
    return lambda a, b: masked(a, b, sizes, offset)


def spmd_fn(name, sizes, mesh, nk=False):
    """All shards of the mesh's "ep" axis at once: rhs [E, K, n] sharded by expert, lhs
    replicated, each device computing its groups and psum adding the partial outputs."""
    e_loc = sizes.shape[0] // mesh.shape["ep"]

    def per_device(a, b):
        first = jax.lax.axis_index("ep") * e_loc
        return jax.lax.psum(impl_fn(name, sizes, first, nk)(a, b), "ep")

    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("ep")), out_specs=P())


def with_pass(f, pass_, w):
    if pass_ == "fwd":
        return f
    return jax.grad(lambda x, y: jnp.sum((f(x, y) * w).astype(jnp.float32)), (0, 1))


def time_ms(fn, args, warmup, reps, inner):
    """(median, min) over reps of the time per call, each rep `inner` calls waited for once."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner - 1):
            fn(*args)
        jax.block_until_ready(fn(*args))
        ts.append(1e3 * (time.perf_counter() - t) / inner)
    return statistics.median(ts), min(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dtype", choices=["bf16", "f16", "f32"], default="bf16")
    ap.add_argument("--shards", default="1,4", help="comma-separated shard counts")
    ap.add_argument("--impls", default="moekit", help="moekit,lax,masked")
    ap.add_argument("--passes", default="fwd,fwd+bwd", help="fwd,fwd+bwd")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls before the timed ones")
    ap.add_argument("--inner", type=int, default=None,
                    help="calls per timed rep (default: 1 on the CPU, 20 on a GPU)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--rhs-layout", choices=["kn", "nk"], default="kn",
                    help="the weights stored [E, K, n] (kn) or [E, n, K] (nk)")
    ap.add_argument("--dims", default=None, metavar="H,F,E,k",
                    help="these sizes instead of the preset's (named 'dims' in the results)")
    ap.add_argument("--json", action="store_true", help="JSON array on stdout, table on stderr")
    a = ap.parse_args()
    if a.dims is not None:
        try:
            H, F, E, k = (int(d) for d in a.dims.split(","))
        except ValueError:
            ap.error(f"--dims {a.dims}: not four comma-separated integers H,F,E,k")
        if min(H, F, E, k) < 1:
            ap.error(f"--dims {a.dims}: every size must be at least 1")
        a.preset = "dims"
    else:
        preset = next((p for p in json.loads(PRESETS.read_text())["presets"]
                       if p["name"] == a.preset), None)
        if preset is None:
            ap.error(f"--preset {a.preset}: not in {PRESETS}")
        E, H, F, k = preset["E"], preset["H"], preset["F"], preset["k"]
    impls = a.impls.split(",")
    for i in impls:
        if i not in ("moekit", "lax", "masked"):
            ap.error(f"--impls: unknown implementation {i!r}")
    passes = a.passes.split(",")
    for p in passes:
        if p not in ("fwd", "fwd+bwd"):
            ap.error(f"--passes: unknown pass {p!r}")
    if a.reps < 1 or a.warmup < 0 or (a.inner is not None and a.inner < 1):
        ap.error(f"--reps {a.reps} --warmup {a.warmup} --inner {a.inner}: need reps >= 1, "
                 f"warmup >= 0 and inner >= 1")
    try:
        shard_counts = [int(s) for s in a.shards.split(",")]
    except ValueError:
        ap.error(f"--shards {a.shards}: not a comma-separated list of integers")
    for s in shard_counts:
        if s < 1 or E % s:
            ap.error(f"--shards {s}: must divide E = {E}")
    dtype = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}[a.dtype]
    devices = jax.devices()
    device = devices[0]
    inner = a.inner or (1 if device.platform == "cpu" else 20)
    too_few = [s for s in shard_counts if s > len(devices)]
    if too_few:
        print(f"spmd with {too_few} shards skipped: {len(devices)} {device.platform} device(s)",
              file=sys.stderr)
    m = a.tokens * k
    rng = np.random.default_rng(a.seed)
    # Drawn in float32: no float64 copy of a preset's weights (4 times their bf16 bytes).
    lhs = jnp.asarray(rng.standard_normal((m, H), np.float32), dtype)
    nk = a.rhs_layout == "nk"
    rhs_all = rng.standard_normal((E, F, H) if nk else (E, H, F), np.float32)
    rhs_all *= np.float32(1 / np.sqrt(H))
    rhs_all = jnp.asarray(rhs_all, dtype)
    w = jnp.asarray(rng.standard_normal((m, F), np.float32), dtype)
    sizes = jnp.asarray(group_sizes(m, E, 0.25, a.seed))

    # (impl, shards, mode, pass): lax has no offset, so only the full call; masked only sharded.
    cases = [(i, 1, "all", p) for i in impls if i != "masked" for p in passes]
    cases += [(i, s, mode, p) for s in shard_counts if s > 1 for mode in ("shard0", "spmd")
              if mode == "shard0" or s <= len(devices) for i in impls if i != "lax"
              for p in passes]
    out = sys.stderr if a.json else sys.stdout
    rows = []
    for n, (impl, shards, mode, pass_) in enumerate(cases, 1):
        print(f"[{n}/{len(cases)}] {impl} {pass_} shards={shards} {mode}", file=sys.stderr,
              flush=True)
        e_loc = E // shards
        if mode == "spmd":
            mesh = Mesh(np.array(devices[:shards]), ("ep",))
            f = spmd_fn(impl, sizes, mesh, nk)
            args = (jax.device_put(lhs, NamedSharding(mesh, P())),
                    jax.device_put(rhs_all, NamedSharding(mesh, P("ep"))))
            computed = int(sizes.sum())
        else:
            f = impl_fn(impl, sizes, jnp.int32(0), nk)
            args = (lhs, rhs_all[:e_loc])
            computed = int(sizes[:e_loc].sum())
        fn = jax.jit(with_pass(f, pass_, w)).lower(*args).compile()
        med, best = time_ms(fn, args, a.warmup, a.reps, inner)
        flops = 2 * computed * H * F * (1 if pass_ == "fwd" else 3)
        rows.append(dict(impl=impl, pass_=pass_, shards=shards, mode=mode, preset=a.preset,
                         tokens=a.tokens, dtype=a.dtype, rhs_layout=a.rhs_layout,
                         device=device.device_kind,
                         rows=computed, ms=med, min_ms=best, tflops=flops / med / 1e9))
    base = {(r["pass_"], r["shards"], r["mode"]): r["ms"] for r in rows if r["impl"] == "moekit"}
    for r in rows:
        r["vs_moekit"] = r["ms"] / base[(r["pass_"], r["shards"], r["mode"])] \
            if (r["pass_"], r["shards"], r["mode"]) in base else None
    layout = "[E, n, K]" if nk else "[E, K, n]"
    print(f"\njax {jax.__version__} on {device.device_kind}, {a.preset} (m={m} K={H} n={F} "
          f"E={E}, weights {layout}), {a.dtype}, median of {a.reps} reps of {inner} call(s) "
          f"after {a.warmup} untimed; shard0: one shard's call (E/S groups); spmd: all S shards "
          f"in shard_map on S devices; rows: rows computed (by moekit); TFLOP/s of the useful "
          f"work", file=out)
    print(f"{'impl':>7} {'pass':>8} {'shards':>6} {'mode':>6} {'rows':>7} {'ms':>10} "
          f"{'min ms':>10} {'TFLOP/s':>8} {'x moekit':>9}", file=out)
    for r in rows:
        ratio = f"{r['vs_moekit']:.2f}" if r["vs_moekit"] is not None else "-"
        print(f"{r['impl']:>7} {r['pass_']:>8} {r['shards']:>6} {r['mode']:>6} {r['rows']:>7} "
              f"{r['ms']:>10.3f} {r['min_ms']:>10.3f} {r['tflops']:>8.2f} {ratio:>9}", file=out)
    if a.json:
        print(json.dumps([{("pass" if k == "pass_" else k): v for k, v in r.items()}
                          for r in rows], indent=1))


if __name__ == "__main__":
    main()
