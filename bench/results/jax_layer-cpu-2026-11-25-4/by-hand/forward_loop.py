# The fused moe_layer forward timed call by call, alone, then each right after a forward +
# backward: .venv/bin/python bench/results/jax_layer-cpu-2026-11-25-4/by-hand/forward_loop.py
# (from the checkout root; forward_loop.txt is its output).
import sys, time, resource, argparse
sys.path.insert(0, 'bench')
import moekit.jax as mj
import jax, jax_layer as jl
a = argparse.Namespace(preset='olmoe-1b-7b', tokens=4096, dtype='bf16', seed=0)
p, x, params, fns = jl.setup(a)
f = fns['moekit']['fwd']
jax.block_until_ready(f(x, params)); jax.block_until_ready(f(x, params))
ts=[]
for i in range(15):
    r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
    out = jax.block_until_ready(f(x, params))
    t1 = time.perf_counter(); r1 = resource.getrusage(resource.RUSAGE_SELF)
    del out
    ts.append((1e3*(t1-t0), 1e3*(r1.ru_utime-r0.ru_utime), 1e3*(r1.ru_stime-r0.ru_stime), r1.ru_minflt-r0.ru_minflt, r1.ru_nivcsw-r0.ru_nivcsw, r1.ru_nvcsw-r0.ru_nvcsw))
for t in ts: print("wall %.0f user %.0f sys %.0f minflt %d invcsw %d vcsw %d" % t)
g = fns['moekit']['fwd+bwd']
jax.block_until_ready(g(x, params))
print("after a forward + backward:")
ts=[]
for i in range(8):
    out = jax.block_until_ready(g(x, params)); del out
    r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
    out = jax.block_until_ready(f(x, params))
    t1 = time.perf_counter(); r1 = resource.getrusage(resource.RUSAGE_SELF)
    del out
    ts.append((1e3*(t1-t0), 1e3*(r1.ru_utime-r0.ru_utime), 1e3*(r1.ru_stime-r0.ru_stime), r1.ru_minflt-r0.ru_minflt, r1.ru_nivcsw-r0.ru_nivcsw, r1.ru_nvcsw-r0.ru_nvcsw))
for t in ts: print("wall %.0f user %.0f sys %.0f minflt %d invcsw %d vcsw %d" % t)
