"""Times moekit.jax.moe_layer on one device beside the C++ layer and beside the same layer
written with jax.lax.ragged_dot and jnp, forward and forward + backward, on a preset's shapes.

    .venv/bin/python bench/jax_layer.py --preset qwen3-30b-a3b --tokens 4096 [--dtype bf16] \
        [--impls moekit,steps,lax,cpp] [--rounds 3] [--reps 3] [--warmup 1] [--inner N] \
        [--moekit build/moekit] [--packed-weights] [--json]

It runs on JAX's default device: the CPU, or a GPU where jax has one (moekit's CUDA handlers;
the C++ layer then runs with --device cuda).

Implementations:
  moekit  moekit.jax.moe_layer as a user calls it, the preset's routing and shared experts,
          SwiGLU, the load-balancing loss (coefficient 0.01): on the CPU one FFI call each way
          (the C++ layer's forward and backward, fused=True), on a GPU step by step.
  steps   moe_layer(..., fused=False): each step (route, permute, ragged_dot, activation,
          unpermute, the losses) an FFI call of its own, XLA's dot for the router and the shared
          expert: the path the expert-parallel layer takes.
  lax     the same layer in jax.lax.ragged_dot and jnp, as MaxText's sparse path writes it: top-k
          routing in jnp, an argsort of the chosen experts as the permutation, a gather of the
          rows, jax.lax.ragged_dot for both grouped matmuls, the inverse gather and a weighted
          sum as the combine, the load-balancing loss from the routing's counts.
  cpp     the C++ layer: `moekit bench layer --json` with the same preset, tokens, dtype and
          loss, in a process of its own (its forward and backward, each its median of --reps).
With --packed-weights (bf16 or f32, the CPU): moekit and cpp only, the forward only, on the experts'
weights packed once (moekit.jax.pack_ragged_rhs; the C++ layer's `moekit bench layer
--packed-weights`, its packed_weights_ms): what the binding costs for inference.
Forward + backward is jax.value_and_grad of sum(out * ct) + the loss, to x and every weight
(the C++ layer: its forward plus its backward). Compilation is not timed: each JAX layer is
compiled ahead of time, and the GiB of temporaries XLA asks for are printed before it first
runs (and in the JSON, <impl>_xla_temp_gib), so that a device out of memory says whose. Each
round runs every implementation in turn, --reps timed runs each after --warmup untimed ones,
each run --inner calls issued back to back and waited for once (default 1 on the CPU, 10 on a GPU); the table
gives the median over the rounds of each round's median, and the ratios to the C++ layer.
The JSON also gives the MB of pages each JAX layer's timed calls first touched (minor faults, a
call's mean; the C++ layer reuses its buffers), and whether moekit.jax's malloc settings were made
(kept_large_blocks; README): XLA allocates every result anew, and a block glibc maps afresh
faults in again, 4 KiB at a time, on every call.
XLA_PYTHON_CLIENT_PREALLOCATE=false unless set, so that the C++ process finds GPU memory.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import platform
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

PRESETS = pathlib.Path(__file__).with_name("presets.json")
ROOT = pathlib.Path(__file__).resolve().parent.parent
IMPLS = ("moekit", "steps", "lax", "cpp")
RATIOS = (("moekit", "cpp"), ("steps", "cpp"), ("lax", "moekit"))  # the table's a/b columns


def preset(name):
    presets = json.loads(PRESETS.read_text())["presets"]
    for p in presets:
        if p["name"] == name:
            return p
    raise SystemExit(f"unknown --preset {name!r}; known: {', '.join(p['name'] for p in presets)}")


def routing_kw(p):
    kw = dict(k=p["k"], score=p["score"], pre_softmax=p["pre_softmax"])
    if p.get("num_groups"):
        kw.update(num_groups=p["num_groups"], group_topk=p["group_topk"])
    kw["scaling_factor"] = p.get("scaling_factor", 1.0)
    return kw


def lax_layer(x, params, *, k, score, pre_softmax, num_groups=None, group_topk=None,
              scaling_factor=1.0, expert_bias=None, aux_loss_coeff=0.0):
    """The reference: the layer in jax.lax.ragged_dot and jnp (argsort permutation)."""
    import jax
    import jax.numpy as jnp
    f32 = jnp.float32
    T, H = x.shape
    E = params.router.shape[1]
    logits = jnp.dot(x, params.router, preferred_element_type=f32)  # [T, E]
    if score == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        if pre_softmax:
            weights, idx = jax.lax.top_k(probs, k)
        else:
            top, idx = jax.lax.top_k(logits, k)
            weights = jax.nn.softmax(top, axis=-1)
    else:
        s = jax.nn.sigmoid(logits) if score == "sigmoid" else jnp.sqrt(jax.nn.softplus(logits))
        sel = s if expert_bias is None else s + expert_bias
        if num_groups:
            grouped = sel.reshape(T, num_groups, E // num_groups)
            group_score = jnp.sum(jax.lax.top_k(grouped, k // group_topk)[0], axis=-1)
            _, keep = jax.lax.top_k(group_score, group_topk)
            mask = jnp.zeros((T, num_groups), bool).at[jnp.arange(T)[:, None], keep].set(True)
            sel = jnp.where(jnp.repeat(mask, E // num_groups, axis=1), sel, -jnp.inf)
        _, idx = jax.lax.top_k(sel, k)
        weights = jnp.take_along_axis(s, idx, axis=1)
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        probs = s / (jnp.sum(s, axis=-1, keepdims=True) + 1e-20)
    weights = weights * scaling_factor
    flat = idx.reshape(-1)  # [T * k]
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    rows = x[order // k]  # [T * k, H], expert-major
    h = jax.lax.ragged_dot(rows, params.w_in, sizes)
    gate, up = jnp.split(h.astype(f32), 2, axis=-1)
    a = (jax.nn.silu(gate) * up).astype(x.dtype)
    y = jax.lax.ragged_dot(a, params.w_out, sizes)  # [T * k, H]
    y = y[jnp.argsort(order)].reshape(T, k, H)
    out = jnp.einsum("tkh,tk->th", y.astype(f32), weights).astype(x.dtype)
    if params.shared_in is not None:
        hs = jnp.dot(x, params.shared_in, preferred_element_type=f32)
        g, u = jnp.split(hs, 2, axis=-1)
        a_s = (jax.nn.silu(g) * u).astype(x.dtype)
        out = out + jnp.dot(a_s, params.shared_out, preferred_element_type=f32).astype(x.dtype)
    aux = aux_loss_coeff * E / (k * T * T) * jnp.sum(jnp.sum(probs, axis=0) * sizes)
    return out, aux


def needed_gib(p, T, dtype, jax_impls, cpp, packed=False):
    """About the GiB a preset's run holds at its peak, the C++ layer's process (which runs while
    the JAX process keeps its arrays) included. Measured peaks (ru_maxrss, bf16, 4096 tokens):
    the JAX process 5.4 times the weights' bytes with one JAX layer and 6.4 times with two at
    mixtral-8x7b (the weights, their gradients, the backward's f32 scratch, and the heap's
    high-water mark: freed blocks stay in the process, README), 5.8-8.6 times at the smaller
    presets, where the routed rows weigh more; the C++ process 3.7 times (10.3 GB). Counted here
    in the JAX process the weights, and with a JAX layer 3 times the weights and twice the
    activations more (x, the output and their cotangents; per routed row x_perm, h, a, y:
    2H + 3F elements, saved and as gradients), the weights once more for each further one; in
    the C++ process 3.5 times the weights and the activations. With packed weights (the forward
    only) the JAX process holds them twice (as given and packed) and no gradient, the C++ process
    a packed copy more."""
    H, F, E, k = p["H"], p["F"], p["E"], p["k"]
    Fs = p["shared_experts"] * F
    es = 2 if dtype == "bf16" else 4
    weights = H * E + E * H * 2 * F + E * F * H + H * 2 * Fs + Fs * H
    activations = 4 * T * H + 2 * T * k * (2 * H + 3 * F)
    total = weights
    if jax_impls:
        total += (weights + activations if packed else
                  (3 + jax_impls - 1) * weights + 2 * activations)
    if cpp:
        total += (4.5 if packed else 3.5) * weights + activations
    return total * es / 2**30


def physical_gib():
    """The machine's memory (MemTotal), in GiB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    return 16.0


def setup(args):
    import jax
    import jax.numpy as jnp
    import moekit.jax as mj

    p = preset(args.preset)
    H, F, E, T = p["H"], p["F"], p["E"], args.tokens
    Fs = p["shared_experts"] * F
    dtype = jnp.bfloat16 if args.dtype == "bf16" else jnp.float32
    ks = jax.random.split(jax.random.key(args.seed), 8)
    normal = lambda key, shape, scale: (jax.random.normal(key, shape) * scale).astype(dtype)
    x = normal(ks[0], (T, H), 0.5)
    ct = normal(ks[1], (T, H), 1.0)
    params = mj.MoeParams(normal(ks[2], (H, E), H**-0.5), normal(ks[3], (E, H, 2 * F), H**-0.5),
                          normal(ks[4], (E, F, H), F**-0.5),
                          normal(ks[5], (H, 2 * Fs), H**-0.5) if Fs else None,
                          normal(ks[6], (Fs, H), Fs**-0.5) if Fs else None)
    if args.packed_weights:
        params = params._replace(w_in=mj.pack_ragged_rhs(params.w_in),
                                 w_out=mj.pack_ragged_rhs(params.w_out))
    kw = routing_kw(p)
    if p.get("expert_bias"):
        kw["expert_bias"] = jax.random.uniform(ks[7], (E,), minval=-0.1, maxval=0.1)

    def moekit_layer(x, params, fused=None):
        out, aux = mj.moe_layer(x, params, aux_loss_coeff=0.01, fused=fused, **kw)
        return out, aux.aux_loss

    def reference(x, params):
        return lax_layer(x, params, aux_loss_coeff=0.01, **kw)

    def passes(layer):
        fwd = jax.jit(lambda x, params: layer(x, params)[0])

        def loss(x, params):
            out, aux = layer(x, params)
            return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)) + aux
        fwd_bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        return {"fwd": fwd, "fwd+bwd": fwd_bwd}

    steps = functools.partial(moekit_layer, fused=False)
    return p, x, params, {"moekit": passes(moekit_layer), "steps": passes(steps),
                          "lax": passes(reference)}


def xla_temp_gib(compiled):
    """The GiB of temporaries a compiled function asks XLA for (NaN where the backend says not)."""
    m = compiled.memory_analysis()
    return m.temp_size_in_bytes / 2**30 if m is not None else float("nan")


def time_call(fn, args, warmup, reps, inner):
    """(median ms per call, MB first touched per call) of `reps` runs of `inner` calls each,
    after `warmup` runs. Each run's results are dropped before the next run starts, as a
    training step's gradients are once applied and as the C++ bench reuses its buffers: kept,
    they would make every call allocate its results (1.2 GB of weight gradients at qwen3's
    shapes) beside the last call's."""
    import jax
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(reps):
        t0 = time.perf_counter()
        out = [fn(*args) for _ in range(inner)]
        jax.block_until_ready(out)
        times.append(1e3 * (time.perf_counter() - t0) / inner)
        del out
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return statistics.median(times), faults * resource.getpagesize() / 1e6 / (reps * inner)


def cpp_layer(args, device):
    """The C++ layer's forward and backward ms (its own medians), from `moekit bench layer`."""
    cmd = [args.moekit, "bench", "layer", "--preset", args.preset, "--tokens", str(args.tokens),
           "--dtype", args.dtype, "--reps", str(args.reps), "--warmup", str(args.warmup),
           "--aux-loss-coeff", "0.01", "--device", device, "--mem-limit-gib",
           str(args.mem_limit_gib), "--json"] + (["--packed-weights"] if args.packed_weights else [])
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stderr[-3000:]}")
    cases = {c["pass"]: c for c in json.loads(run.stdout)}
    if not cases:  # it skipped the preset
        raise SystemExit(f"{' '.join(cmd)} timed nothing:\n{run.stderr[-3000:]}")
    if args.packed_weights:
        return {"fwd": cases["fwd"]["packed_weights_ms"]}
    cases = {ps: c["ms"] for ps, c in cases.items()}
    return {"fwd": cases["fwd"], "fwd+bwd": cases["fwd"] + cases["bwd"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b",
                    help="a preset of bench/presets.json, or 'all'")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    ap.add_argument("--impls", default=None,
                    help="default: moekit,lax,cpp on a GPU; moekit,steps,cpp on the CPU, where "
                         "XLA's ragged_dot computes every row against every group (E times the "
                         "work)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--inner", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mem-limit-gib", type=float, default=None,
                    help="skip a preset whose run would hold more than this, its JAX and C++ "
                         "processes together (default: 80%% of the machine's memory; the C++ "
                         "layer's own process checks its buffers against the same limit)")
    ap.add_argument("--moekit", default=str(ROOT / "build" / "moekit"),
                    help="the moekit program, for the C++ layer (impl cpp)")
    ap.add_argument("--packed-weights", action="store_true",
                    help="the forward on packed experts' weights (bf16 or f32, CPU; moekit and cpp)")
    ap.add_argument("--json", action="store_true", help="the results as JSON on stdout")
    args = ap.parse_args()
    import jax
    # Before the first JAX computation, as a user would (README: its malloc settings apply to the
    # threads XLA starts after it; imported later, every large result is mapped anew).
    import moekit.jax as mj
    backend = jax.default_backend()
    default = ("moekit,cpp" if args.packed_weights else
               "moekit,lax,cpp" if backend == "gpu" else "moekit,steps,cpp")
    impls = [i for i in (args.impls or default).split(",") if i]
    for i in impls:
        if i not in IMPLS:
            raise SystemExit(f"--impls: unknown {i!r}; known: {', '.join(IMPLS)}")
    if args.packed_weights and (backend != "cpu" or args.dtype not in ("bf16", "f32")
                                or not set(impls) <= {"moekit", "cpp"}):
        raise SystemExit("--packed-weights: the forward on the CPU in bf16 or f32, --impls "
                         f"moekit,cpp (here {backend}, {args.dtype}, {','.join(impls)})")
    if "cpp" in impls and not os.access(args.moekit, os.X_OK):
        raise SystemExit(f"--moekit {args.moekit}: not an executable (build it, or drop cpp "
                         "from --impls)")

    device = "cuda" if backend == "gpu" else "cpu"
    if args.mem_limit_gib is None:
        args.mem_limit_gib = round(0.8 * physical_gib(), 1)
    inner = args.inner or (10 if backend == "gpu" else 1)
    names = ([p["name"] for p in json.loads(PRESETS.read_text())["presets"]]
             if args.preset == "all" else [args.preset])
    text = sys.stderr if args.json else sys.stdout
    if backend == "gpu":
        machine = str(jax.devices()[0].device_kind)
    else:
        machine = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                        if line.startswith("model name")), platform.processor())
        machine += f" ({os.cpu_count()} cores)"
    passes = ("fwd",) if args.packed_weights else ("fwd", "fwd+bwd")
    steps = len(names) * args.rounds
    rows, skipped = [], []
    for n, name in enumerate(names):
        args.preset = name
        gib = needed_gib(preset(name), args.tokens, args.dtype,
                         len([i for i in impls if i != "cpp"]), "cpp" in impls,
                         args.packed_weights)
        if gib > args.mem_limit_gib:
            skipped.append(f"{name}: needs about {gib:.1f} GiB at {args.tokens} tokens, over "
                           f"--mem-limit-gib {args.mem_limit_gib:g} (fewer --impls per run "
                           f"need less)")
            print(f"skipped {skipped[-1]}", file=sys.stderr, flush=True)
            continue
        p, x, params, fns = setup(args)
        outs, temp_gib = {}, {}
        for impl in impls:  # compiled before anything is timed
            if impl != "cpp":
                for ps in passes:
                    # Ahead of time, to say what XLA asks for before it runs: jax.lax.ragged_dot's
                    # layer asked for 34 GiB forward and 148 GiB forward + backward at
                    # qwen3-30b-a3b's 4096 tokens on the CPU (moekit's 0.4 and 0.7), and an H200
                    # ran out of memory on it.
                    fns[impl][ps] = fns[impl][ps].lower(x, params).compile()
                    temp_gib[(impl, ps)] = xla_temp_gib(fns[impl][ps])
                    print(f"{name} {args.tokens} tokens: {impl} {ps} compiled, XLA's temporaries "
                          f"{temp_gib[(impl, ps)]:.2f} GiB", file=sys.stderr, flush=True)
                for ps in passes:
                    out = jax.block_until_ready(fns[impl][ps](x, params))
                    if ps == "fwd":  # the gradients dropped: a preset's weights' worth each
                        outs[(impl, ps)] = out
                    del out
        # The JAX layers compute the same function: each one's output against moekit's,
        # relative to the largest.
        agree = {}
        for other in ("steps", "lax"):
            if ("moekit", "fwd") in outs and (other, "fwd") in outs:
                a = np.asarray(outs[("moekit", "fwd")], np.float32)
                b = np.asarray(outs[(other, "fwd")], np.float32)
                agree[other] = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
        rounds = {(i, ps): [] for i in impls for ps in passes}
        faulted = {(i, ps): [] for i in impls for ps in passes if i != "cpp"}
        for r in range(args.rounds):
            print(f"[{n * args.rounds + r + 1}/{steps}] {name} {args.tokens} tokens: round "
                  f"{r + 1} of {', '.join(impls)}", file=sys.stderr, flush=True)
            for impl in impls:
                if impl == "cpp":
                    for ps, ms in cpp_layer(args, device).items():
                        rounds[(impl, ps)].append(ms)
                    continue
                for ps in passes:
                    ms, mb = time_call(fns[impl][ps], (x, params), args.warmup, args.reps, inner)
                    rounds[(impl, ps)].append(ms)
                    faulted[(impl, ps)].append(mb)
        for ps in passes:
            row = {"op": "jax_layer", "preset": name, "tokens": args.tokens, "dtype": args.dtype,
                   "pass": ps, "packed_weights": args.packed_weights, "device": device, "machine": machine, "rounds": args.rounds,
                   "reps": args.reps, "inner": inner,
                   "kept_large_blocks": mj._ffi.KEPT_LARGE_BLOCKS,
                   # The process's peak so far (every preset before this one included).
                   "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                   **{f"{o}_vs_moekit_max_rel_diff": d for o, d in agree.items()}}
            for impl in impls:
                row[f"{impl}_ms"] = statistics.median(rounds[(impl, ps)])
                row[f"{impl}_rounds_ms"] = rounds[(impl, ps)]
                if impl != "cpp":
                    row[f"{impl}_rounds_faulted_mb"] = faulted[(impl, ps)]
                    row[f"{impl}_xla_temp_gib"] = temp_gib[(impl, ps)]
            rows.append(row)

    what = ("the forward on packed experts' weights" if args.packed_weights else
            "forward and forward + backward")
    print(f"moe_layer on one {device} device: {machine}; {args.dtype}, {what}, median over {args.rounds} rounds of each round's median of {args.reps}",
          file=text)
    ratios = [(a, b) for a, b in RATIOS if a in impls and b in impls]
    print(f"{'preset':<18} {'tokens':>6} {'pass':>8}" + "".join(f" {i + ' ms':>10}" for i in impls)
          + "".join(f" {a + '/' + b:>11}" for a, b in ratios), file=text)
    for row in rows:
        print(f"{row['preset']:<18} {row['tokens']:>6} {row['pass']:>8}"
              + "".join(f" {row[i + '_ms']:>10.3f}" for i in impls)
              + "".join(f" {row[a + '_ms'] / row[b + '_ms']:>10.2f}x" for a, b in ratios),
              file=text)
    for s in skipped:
        print(f"skipped {s}", file=text)
    for other in ("steps", "lax"):
        diffs = [r[f"{other}_vs_moekit_max_rel_diff"] for r in rows
                 if f"{other}_vs_moekit_max_rel_diff" in r]
        if diffs:
            print(f"the {other} layer's output against moekit's: max |difference| / max |output| "
                  f"= {max(diffs):.2g} (rounding, and a routing tie decided otherwise)", file=text)
    print("moekit/cpp: moekit.jax's time over the C++ layer's (1.00x: the binding costs nothing); "
          "steps/cpp: the same, step by step; lax/moekit: the jax.lax.ragged_dot + jnp layer's "
          "time over moekit.jax's (how much faster moekit is).", file=text)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
