"""N calls of one of bench/jax_layer.py's jitted passes after one warm-up, each printing its ms,
the MB it faulted in (minor faults), and its user and system seconds. From the repository's root:

    TOK=4096 .venv/bin/python bench/results/jax_layer-cpu-2026-11-25-3/by-hand/faults.py \
        moekit fwd+bwd 5
"""
import argparse, os, resource, sys, time
sys.path.insert(0, "bench")
import jax, jax_layer
_, x, params, fns = jax_layer.setup(argparse.Namespace(preset="qwen3-30b-a3b", tokens=int(os.environ.get("TOK", "4096")), dtype="bf16", seed=0))
impl, pas, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
fn = fns[impl][pas]
jax.block_until_ready(fn(x, params))
for i in range(n):
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = fn(x, params); jax.block_until_ready(out); del out
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    print(impl, pas, i, round(1e3 * (time.perf_counter() - t0)), "ms faultedMB",
          round((r1.ru_minflt - r0.ru_minflt) * 4096 / 1e6), "user", round(r1.ru_utime - r0.ru_utime, 2),
          "sys", round(r1.ru_stime - r0.ru_stime, 2), flush=True)
