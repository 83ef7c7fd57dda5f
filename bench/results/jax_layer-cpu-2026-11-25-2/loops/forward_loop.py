"""The fused forward alone, 6 calls after 1 warm-up, each call's results dropped ("del") or kept
until the next ("keep"): ms, MB faulted and user time per call. From the repository's root:

    .venv/bin/python bench/results/jax_layer-cpu-2026-11-25-2/loops/forward_loop.py del
    .venv/bin/python bench/results/jax_layer-cpu-2026-11-25-2/loops/forward_loop.py keep
"""
import argparse
import resource
import sys
import time

sys.path.insert(0, "bench")
import jax  # noqa: E402
import jax_layer  # noqa: E402

mode = sys.argv[1]
_, x, params, fns = jax_layer.setup(argparse.Namespace(preset="qwen3-30b-a3b", tokens=4096,
                                                       dtype="bf16", seed=0))
fn = fns["moekit"]["fwd"]
jax.block_until_ready(fn(x, params))
kept = None
for i in range(6):
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = [fn(x, params)]
    jax.block_until_ready(out)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    print(mode, i, round(1e3 * (time.perf_counter() - t0)), "ms, faulted MB",
          round((r1.ru_minflt - r0.ru_minflt) * 4096 / 1e6), "user s",
          round(r1.ru_utime - r0.ru_utime, 2), flush=True)
    if mode == "keep":
        kept = out
    del out
