"""A process to attach `perf record` to: 2 forward + backward calls of moe_layer (IMPL: moekit,
the fused default, or steps), then it writes its pid to /tmp/perf_ready, waits 3 s, runs 3
calls printing ms, MB faulted and user / system time, and writes /tmp/perf_done. From the
repository's root:

    .venv/bin/python bench/results/jax_layer-cpu-2026-11-25-2/loops/perf_target.py IMPL &
    while [ ! -f /tmp/perf_ready ]; do sleep 1; done
    perf record -e cpu-clock -F 499 -g -p $(cat /tmp/perf_ready) -o perf.data &
    while [ ! -f /tmp/perf_done ]; do sleep 1; done; kill -INT %2
    perf report -i perf.data --no-children --sort dso
"""
import argparse
import os
import resource
import sys
import time

sys.path.insert(0, "bench")
import jax  # noqa: E402
import jax_layer  # noqa: E402

_, x, params, fns = jax_layer.setup(argparse.Namespace(preset="qwen3-30b-a3b", tokens=4096,
                                                       dtype="bf16", seed=0))
fn = fns[sys.argv[1]]["fwd+bwd"]
for _ in range(2):
    jax.block_until_ready(fn(x, params))
with open("/tmp/perf_ready", "w") as f:
    f.write(str(os.getpid()))
time.sleep(3)
for i in range(3):
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = fn(x, params)
    jax.block_until_ready(out)
    del out
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    print(i, round(1e3 * (time.perf_counter() - t0)), "ms, faulted MB",
          round((r1.ru_minflt - r0.ru_minflt) * 4096 / 1e6), "user s",
          round(r1.ru_utime - r0.ru_utime, 2), "system s", round(r1.ru_stime - r0.ru_stime, 2),
          flush=True)
with open("/tmp/perf_done", "w") as f:
    f.write("1")
