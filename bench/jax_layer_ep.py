"""Times moekit.jax.moe_layer with expert parallelism (ep_axis, under shard_map) against
moe_layer on one device, on the same global tokens, forward + backward.

    .venv/bin/python bench/jax_layer_ep.py --preset qwen3-30b-a3b --tokens 4096 \
        [--devices 1,2,4] [--processes 2,4] [--dtype bf16] [--reps 3] [--warmup 1] [--json]

--tokens is the global batch: each of D devices holds tokens / D of them and E / D experts.

--devices: D CPU devices of one process, each count in a process of its own (XLA_FLAGS must be
set before jax starts), which times, run by run in turn:
  one       moe_layer on all the tokens, on device 0 (its default: fused, one call each way)
  one_steps the same step by step (fused=False), the path the expert-parallel layer takes
  ep        the layer with ep_axis over the D devices, ep_exchange="all_to_all"
  exchange  the exchange alone: moekit.jax.ep.dispatch then combine of each device's permuted
            rows (the same counts as the layer's first step), forward only
The D devices share the machine's cores (XLA runs each device's part on threads of its own, and
moekit's kernels inside use OpenMP), so "ep" against "one" is the price of splitting the layer,
padding included, on the same cores. XLA's all_to_all exchanges equal blocks: each device sends
every peer a block of C rows (C = all its N rows, dropless), D * C rows where the routing needs N
(the "moved / needed" column).

--processes: P processes under mpiexec (jax.distributed with gloo, one device each, cores / P
OpenMP threads each, bound to a core where P <= cores), which time in turn the layer with
ep_exchange="mpi" (moekit's MPI engine, only the routed rows) and "all_to_all" (XLA's over
gloo), and each exchange alone; each run's time is the slowest process's. The one-device
reference runs in a process of its own with every core, launched just before.

Forward + backward is jax.value_and_grad of sum(out * ct) + the load-balancing loss, to x and
every weight; compilation is not timed.
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


def setup(args, devices):
    """The problem (the same values for every launch of one seed), and the timed functions'
    builders for a mesh of `devices`."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import moekit.jax as mj

    p = preset(args.preset)
    H, F, E, k, T = p["H"], p["F"], p["E"], p["k"], args.tokens
    D = len(devices)
    if E % D or T % D:
        raise SystemExit(f"{p['name']}: E = {E} and --tokens {T} must divide by {D} devices")
    dtype = jnp.bfloat16 if args.dtype == "bf16" else jnp.float32
    ks = jax.random.split(jax.random.key(args.seed), 6)
    x = (jax.random.normal(ks[0], (T, H)) / 2).astype(dtype)
    ct = jax.random.normal(ks[1], (T, H)).astype(dtype)

    def expert_weights(lo, hi):
        """w_in and w_out of experts lo .. hi - 1, each from a key of its own, so that a process
        makes only its own experts' (4 processes holding every expert do not fit in 24 GiB)."""
        def one(e):
            w_in = jax.random.normal(jax.random.fold_in(ks[3], e), (H, 2 * F)) * H**-0.5
            w_out = jax.random.normal(jax.random.fold_in(ks[4], e), (F, H)) * F**-0.5
            return w_in.astype(dtype), w_out.astype(dtype)
        return jax.lax.map(one, jnp.arange(lo, hi))

    router = (jax.random.normal(ks[2], (H, E)) * H**-0.5).astype(dtype)
    kw = dict(k=k, score=p["score"], pre_softmax=p["pre_softmax"], aux_loss_coeff=0.01)
    mesh = Mesh(np.array(devices), ("ep",))
    spec = mj.MoeParams(P(), P("ep"), P("ep"))

    def sharded(exchange):
        return lambda x, params: jax.shard_map(
            lambda x, q: mj.moe_layer(x, q, ep_axis="ep", ep_exchange=exchange, **kw),
            mesh=mesh, in_specs=(P("ep"), spec), out_specs=(P("ep"), P()))(x, params)

    def one(x, params):  # moe_layer's default on one device: fused on the CPU
        return mj.moe_layer(x, params, **kw)

    def one_steps(x, params):  # step by step, the path the expert-parallel layer takes
        return mj.moe_layer(x, params, fused=False, **kw)

    def fwd_bwd(layer, ct):
        def loss(x, params, ct):
            out, aux = layer(x, params)
            return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)) + aux.aux_loss
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        return lambda x, params: step(x, params, ct)

    # The exchange alone, on each device's routed and permuted rows, forward.
    def exchange(kind):
        from moekit.jax import ep, ep_mpi
        mod = ep_mpi if kind == "mpi" else ep

        def per_device(x, router):
            r = mj.route(x @ router, k, score=p["score"], pre_softmax=p["pre_softmax"])
            perm = mj.permute(x, r.topk_indices, num_experts=E)
            local, ex = mod.dispatch(perm.x, perm.tokens_per_expert, "ep",
                                     capacity=perm.x.shape[0])
            return mod.combine(local, ex, "ep")
        return jax.jit(lambda x, router: jax.shard_map(
            per_device, mesh=mesh, in_specs=(P("ep"), P()), out_specs=P("ep"))(x, router))

    N = T // D * k  # rows each device permutes (dropless)
    row = H * np.dtype(dtype).itemsize
    info = {"preset": p["name"], "tokens": T, "dtype": args.dtype, "reps": args.reps,
            # Per device and exchange (forward: dispatch + combine; the backward moves as much).
            "exchange_bytes_padded": 2 * D * N * row, "exchange_bytes_needed": 2 * N * row}
    return dict(x=x, ct=ct, router=router, expert_weights=expert_weights, mesh=mesh, spec=spec,
                sharded=sharded, one=one, one_steps=one_steps,
                fwd_bwd=fwd_bwd, exchange=exchange, info=info)


def time_in_turn(cases, args, sync=None, merge=None):
    """Compiles (and runs once) every case, then times them run by run in turn, so that all see
    the same state of the machine; the median of each. Over processes: sync() before each timed
    run, and merge(times) of each case the times over the processes."""
    import jax
    for fn, a in cases.values():
        jax.block_until_ready(fn(*a))
    times = {name: [] for name in cases}
    for _ in range(args.reps):
        for name, (fn, a) in cases.items():
            for _ in range(args.warmup):
                jax.block_until_ready(fn(*a))
            if sync:
                sync()
            times[name] += time_ms(fn, a, 0, 1)
    return {name: float(statistics.median(merge(t) if merge else t)) for name, t in times.items()}


def run_devices(args):
    """In a process with --devices-here CPU devices: time one, ep and exchange; print JSON."""
    D = args.devices_here
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={D}"
    import jax
    import moekit.jax as mj
    s = setup(args, jax.devices()[:D])
    x, ex = s["x"], s["exchange"]("all_to_all")
    params = mj.MoeParams(s["router"], *s["expert_weights"](0, s["router"].shape[1]))
    ms = time_in_turn({"one": (s["fwd_bwd"](s["one"], s["ct"]), (x, params)),
                       "one_steps": (s["fwd_bwd"](s["one_steps"], s["ct"]), (x, params)),
                       "ep": (s["fwd_bwd"](s["sharded"]("all_to_all"), s["ct"]), (x, params)),
                       "exchange": (ex, (x, params.router))}, args)
    out = dict(s["info"], devices=D, one_ms=ms["one"], one_steps_ms=ms["one_steps"],
               ep_ms=ms["ep"],
               exchange_ms=ms["exchange"], exchange_bytes_moved=s["info"]["exchange_bytes_padded"])
    print(json.dumps(out))


def run_ranks(args):
    """One of P processes under mpiexec, one device each (jax.distributed, gloo): the layer
    with each exchange, and each exchange alone, timed in turn; each time the slowest
    process's. Process 0 prints JSON."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    import moekit.jax as mj
    from jax.sharding import NamedSharding, PartitionSpec as P
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(initialization_timeout=300)
    s = setup(args, jax.devices())
    mesh = s["mesh"]

    def spread(value, pspec):  # every process holds the whole value; each gives its part
        value = np.asarray(value)
        return jax.make_array_from_callback(value.shape, NamedSharding(mesh, pspec),
                                            lambda index: value[index])

    x, ct = spread(s["x"], P("ep")), spread(s["ct"], P("ep"))
    E, D, me = s["router"].shape[1], jax.process_count(), jax.process_index()
    mine = [np.asarray(w) for w in s["expert_weights"](me * E // D, (me + 1) * E // D)]
    params = mj.MoeParams(spread(s["router"], P()), *(
        jax.make_array_from_single_device_arrays((E,) + w.shape[1:], NamedSharding(mesh, P("ep")),
                                                 [jax.device_put(w, jax.local_devices()[0])])
        for w in mine))
    cases = {}
    for kind in ("mpi", "all_to_all"):
        cases[f"ep_{kind}"] = (s["fwd_bwd"](s["sharded"](kind), ct), (x, params))
        cases[f"exchange_{kind}"] = (s["exchange"](kind), (x, params.router))

    def slowest(times):  # each run's time: the slowest process's
        return list(np.max(multihost_utils.process_allgather(np.array(times)), axis=0))

    ms = time_in_turn(cases, args, lambda: multihost_utils.sync_global_devices("run"), slowest)
    if jax.process_index() == 0:
        out = dict(s["info"], processes=jax.process_count(),
                   threads=int(os.environ.get("OMP_NUM_THREADS", "0")),
                   **{f"{name}_ms": v for name, v in ms.items()})
        print(json.dumps(out))
    jax.distributed.shutdown()


def launch(cmd, what, env=None):
    """Runs one timing process (or mpiexec of several); its last stdout line is JSON."""
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode:
        print(run.stdout + run.stderr, file=sys.stderr)
        raise SystemExit(f"{what} failed ({run.returncode})")
    return json.loads(run.stdout.strip().splitlines()[-1])


def print_devices(rows, out):
    print(f"{'devices':>7} {'one ms':>9} {'ep ms':>9} {'ep / one':>9} {'exchange ms':>12} "
          f"{'moved MB':>9} {'needed MB':>10} {'moved/needed':>13}", file=out)
    for r in rows:
        print(f"{r['devices']:>7} {r['one_ms']:>9.1f} {r['ep_ms']:>9.1f} "
              f"{r['one_ms'] / r['ep_ms']:>8.1%} {r['exchange_ms']:>12.1f} "
              f"{r['exchange_bytes_moved'] / 1e6:>9.1f} {r['exchange_bytes_needed'] / 1e6:>10.1f} "
              f"{r['exchange_bytes_moved'] / r['exchange_bytes_needed']:>12.1f}x", file=out)
    print("ep / one: the one-device layer's time over the expert-parallel layer's (throughput, "
          "higher is better). exchange: dispatch + combine alone, forward. moved / needed: bytes "
          "the padded all_to_all moves per device over those the routing sends.", file=out)


def print_processes(rows, out):
    print(f"{'procs':>5} {'thr':>3} {'one ms':>8} {'steps ms':>9} {'ep mpi':>8} {'/ one':>6} "
          f"{'/ steps':>7} {'ep a2a':>8} {'/ one':>6} {'xchg mpi':>9} {'xchg a2a':>9} "
          f"{'MB mpi':>7} {'MB a2a':>7}", file=out)
    for r in rows:
        print(f"{r['processes']:>5} {r['threads']:>3} {r['one_ms']:>8.1f} "
              f"{r['one_steps_ms']:>9.1f} {r['ep_mpi_ms']:>8.1f} "
              f"{r['one_ms'] / r['ep_mpi_ms']:>6.1%} {r['one_steps_ms'] / r['ep_mpi_ms']:>7.1%} "
              f"{r['ep_all_to_all_ms']:>8.1f} {r['one_ms'] / r['ep_all_to_all_ms']:>6.1%} "
              f"{r['exchange_mpi_ms']:>9.1f} {r['exchange_all_to_all_ms']:>9.1f} "
              f"{r['exchange_bytes_needed'] / 1e6:>7.1f} {r['exchange_bytes_padded'] / 1e6:>7.1f}",
              file=out)
    print("procs x thr: processes under mpiexec, one device and thr OpenMP threads each. one: "
          "moe_layer on one device of one process with every core, launched just before (fused: "
          "the C++ layer in one call each way); steps: the same step by step (fused=False), the "
          "path the expert-parallel layer takes. ep: "
          "the layer with ep_exchange=\"mpi\" (moekit's MPI engine, only the routed rows) and "
          "\"all_to_all\" (XLA's all_to_all over gloo, padded blocks), the slowest process's "
          "time. xchg: dispatch + combine alone, forward; MB: bytes each moves per process.",
          file=out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=4096, help="the global batch")
    ap.add_argument("--devices", default="1,2,4",
                    help="devices of one process, comma-separated ('' for none)")
    ap.add_argument("--processes", default="",
                    help="process counts under mpiexec, comma-separated (e.g. 2)")
    ap.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="the results as JSON on stdout")
    ap.add_argument("--devices-here", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ranks-here", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.devices_here is not None:
        run_devices(args)
        return 0
    if args.ranks_here:
        run_ranks(args)
        return 0
    common = ["--preset", args.preset, "--tokens", str(args.tokens), "--dtype", args.dtype,
              "--reps", str(args.reps), "--warmup", str(args.warmup), "--seed", str(args.seed)]
    here = [sys.executable, __file__]
    devices = [int(d) for d in args.devices.split(",") if d]
    processes = [int(p) for p in args.processes.split(",") if p]
    steps, step = len(devices) + 2 * len(processes), 0

    def progress(what):
        nonlocal step
        step += 1
        print(f"[{step}/{steps}] {args.preset} {args.tokens} tokens: {what}", file=sys.stderr,
              flush=True)

    rows, proc_rows = [], []
    for D in devices:
        progress(f"{D} device(s) of one process")
        rows.append(launch(here + ["--devices-here", str(D)] + common, f"{D} devices"))
    cores = os.cpu_count()
    for P in processes:
        progress("the one-device reference")
        one = launch(here + ["--devices-here", "1"] + common, "the reference")
        progress(f"{P} processes under mpiexec")
        threads = max(1, cores // P)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMPI_ALLOW_RUN_AS_ROOT="1",
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        bind = "core" if P <= cores else "none"
        if P * threads > cores:
            print(f"warning: {P} processes x {threads} thread(s) on {cores} cores: "
                  f"oversubscribed", file=sys.stderr)
        r = launch(["mpiexec", "-n", str(P), "--oversubscribe", "--bind-to", bind] + here
                   + ["--ranks-here"] + common, f"{P} processes", env)
        proc_rows.append(dict(r, one_ms=one["one_ms"], one_steps_ms=one["one_steps_ms"]))
    text = sys.stderr if args.json else sys.stdout
    import platform
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    what = (f"{args.preset}, {args.tokens} tokens in all, {args.dtype}, forward + backward, "
            f"median of {args.reps}; {cpu} ({cores} cores)")
    if rows:
        print(f"moekit.jax moe_layer, expert-parallel on D CPU devices of one process against one "
              f"device: {what}", file=text)
        print_devices(rows, text)
    if proc_rows:
        print(f"{chr(10) if rows else ''}moekit.jax moe_layer, expert-parallel on P processes "
              f"(mpiexec, jax.distributed) against one device: {what}", file=text)
        print_processes(proc_rows, text)
    if args.json:
        print(json.dumps(rows + proc_rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
