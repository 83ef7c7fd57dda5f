"""Times moekit.jax.moe_layer with expert parallelism (ep_axis, under shard_map) on D CPU devices
of one process against moe_layer on one device, on the same global tokens, forward + backward.

    .venv/bin/python bench/jax_layer_ep.py --preset qwen3-30b-a3b --tokens 4096 \
        [--devices 1,2,4] [--dtype bf16] [--reps 3] [--warmup 1] [--json]

--tokens is the global batch: each of D devices holds tokens / D of them and E / D experts. Each
device count runs in a process of its own (XLA_FLAGS must be set before jax starts), which times,
run by run in turn:
  one       moe_layer on all the tokens, on device 0
  ep        the layer with ep_axis over the D devices (tokens and experts split)
  exchange  the exchange alone: moekit.jax.ep.dispatch then combine of each device's permuted
            rows (the same counts as the layer's first step), forward only
Forward + backward is jax.value_and_grad of sum(out * ct) + the load-balancing loss, to x and
every weight; compilation is not timed.

The D devices of one process share the machine's cores (XLA runs each device's part on threads
of its own, and moekit's kernels inside use OpenMP), so "ep" against "one" is the price of
splitting the layer, padding included, on the same cores.

The exchange on the CPU is XLA's all_to_all of equal blocks: each device sends every peer a block
of C rows (C = all its N rows, dropless), so it moves D * C rows where the routing needs N (the
"moved / needed" column).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

PRESETS = pathlib.Path(__file__).with_name("presets.json")


def preset(name):
    for p in json.loads(PRESETS.read_text())["presets"]:
        if p["name"] == name:
            return p
    raise SystemExit(f"unknown --preset {name!r}")


def time_ms(fn, args, warmup, reps):
    import jax
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(1e3 * (time.perf_counter() - t0))
    return times


def run_devices(args):
    """In a process with --devices-here CPU devices: time one, ep and exchange; print JSON."""
    D = args.devices_here
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={D}"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import moekit.jax as mj
    from moekit.jax import ep

    p = preset(args.preset)
    H, F, E, k, T = p["H"], p["F"], p["E"], p["k"], args.tokens
    if E % D or T % D:
        raise SystemExit(f"{p['name']}: E = {E} and --tokens {T} must divide by {D} devices")
    dtype = jnp.bfloat16 if args.dtype == "bf16" else jnp.float32
    es = np.dtype(dtype).itemsize
    ks = jax.random.split(jax.random.key(args.seed), 6)
    x = (jax.random.normal(ks[0], (T, H)) / 2).astype(dtype)
    ct = jax.random.normal(ks[1], (T, H)).astype(dtype)
    params = mj.MoeParams((jax.random.normal(ks[2], (H, E)) * H**-0.5).astype(dtype),
                          (jax.random.normal(ks[3], (E, H, 2 * F)) * H**-0.5).astype(dtype),
                          (jax.random.normal(ks[4], (E, F, H)) * F**-0.5).astype(dtype))
    kw = dict(k=k, score=p["score"], pre_softmax=p["pre_softmax"], aux_loss_coeff=0.01)
    mesh = Mesh(np.array(jax.devices()[:D]), ("ep",))
    spec = mj.MoeParams(P(), P("ep"), P("ep"))

    def sharded(x, params):
        return jax.shard_map(lambda x, q: mj.moe_layer(x, q, ep_axis="ep", **kw), mesh=mesh,
                             in_specs=(P("ep"), spec), out_specs=(P("ep"), P()))(x, params)

    def one(x, params):
        return mj.moe_layer(x, params, **kw)

    def fwd_bwd(layer):
        def loss(x, params):
            out, aux = layer(x, params)
            return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)) + aux.aux_loss
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    # The exchange alone, on each device's routed and permuted rows.
    def exchange(x, router):
        def per_device(x, router):
            r = mj.route(x @ router, k, score=p["score"], pre_softmax=p["pre_softmax"])
            perm = mj.permute(x, r.topk_indices, num_experts=E)
            local, ex = ep.dispatch(perm.x, perm.tokens_per_expert, "ep",
                                    capacity=perm.x.shape[0])
            return ep.combine(local, ex, "ep")
        return jax.shard_map(per_device, mesh=mesh, in_specs=(P("ep"), P()),
                             out_specs=P("ep"))(x, router)

    cases = {"one": (fwd_bwd(one), (x, params)), "ep": (fwd_bwd(sharded), (x, params)),
             "exchange": (jax.jit(exchange), (x, params.router))}
    for fn, a in cases.values():  # compile (and check they run) before anything is timed
        jax.block_until_ready(fn(*a))
    times = {name: [] for name in cases}
    for _ in range(args.reps):  # in turn, so that all see the same state of the machine
        for name, (fn, a) in cases.items():
            times[name] += time_ms(fn, a, args.warmup, 1)
    N = T // D * k  # rows each device permutes (dropless)
    row = H * es
    out = {"devices": D, "preset": p["name"], "tokens": T, "dtype": args.dtype,
           "reps": args.reps,
           "one_ms": statistics.median(times["one"]), "ep_ms": statistics.median(times["ep"]),
           "exchange_ms": statistics.median(times["exchange"]),
           # Per device and exchange (forward: dispatch + combine; the backward moves as much).
           "exchange_bytes_moved": 2 * D * N * row, "exchange_bytes_needed": 2 * N * row}
    print(json.dumps(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=4096, help="the global batch")
    ap.add_argument("--devices", default="1,2,4")
    ap.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="one JSON object per device count")
    ap.add_argument("--devices-here", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.devices_here is not None:
        run_devices(args)
        return 0
    rows = []
    counts = [int(d) for d in args.devices.split(",")]
    for i, D in enumerate(counts):
        print(f"[{i + 1}/{len(counts)}] {args.preset} {args.tokens} tokens on {D} device(s)",
              file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--devices-here", str(D), "--preset", args.preset,
               "--tokens", str(args.tokens), "--dtype", args.dtype, "--reps", str(args.reps),
               "--warmup", str(args.warmup), "--seed", str(args.seed)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            print(run.stdout + run.stderr, file=sys.stderr)
            return run.returncode
        rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
    text = sys.stderr if args.json else sys.stdout
    import platform
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                if l.startswith("model name")), platform.processor())
    print(f"moekit.jax moe_layer, expert-parallel on D CPU devices of one process against one "
          f"device: {args.preset}, {args.tokens} tokens in all, {args.dtype}, forward + backward, "
          f"median of {args.reps}; {cpu} ({os.cpu_count()} cores)", file=text)
    print(f"{'devices':>7} {'one ms':>9} {'ep ms':>9} {'ep / one':>9} {'exchange ms':>12} "
          f"{'moved MB':>9} {'needed MB':>10} {'moved/needed':>13}", file=text)
    for r in rows:
        print(f"{r['devices']:>7} {r['one_ms']:>9.1f} {r['ep_ms']:>9.1f} "
              f"{r['one_ms'] / r['ep_ms']:>8.1%} {r['exchange_ms']:>12.1f} "
              f"{r['exchange_bytes_moved'] / 1e6:>9.1f} {r['exchange_bytes_needed'] / 1e6:>10.1f} "
              f"{r['exchange_bytes_moved'] / r['exchange_bytes_needed']:>12.1f}x", file=text)
    print("ep / one: the one-device layer's time over the expert-parallel layer's (throughput, "
          "higher is better). exchange: dispatch + combine alone, forward. moved / needed: bytes "
          "the padded all_to_all moves per device over those the routing sends.", file=text)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
