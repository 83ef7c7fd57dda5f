"""What XLA asks for: each JAX layer of bench/jax_layer.py compiled ahead of time, its memory analysis.

    .venv/bin/python bench/results/jax_layer-memory-cpu-2026-11-26/memory_analysis.py PRESET TOKENS IMPLS
"""
import sys, argparse
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
import jax
import jax_layer as jl
ap = argparse.Namespace(preset=sys.argv[1], tokens=int(sys.argv[2]), dtype='bf16', seed=0)
p, x, params, fns = jl.setup(ap)
for impl in sys.argv[3].split(','):
    for ps in ('fwd', 'fwd+bwd'):
        c = fns[impl][ps].lower(x, params).compile()
        m = c.memory_analysis()
        print(f"{impl:7} {ps:8} temp {m.temp_size_in_bytes/2**30:7.2f} GiB  args {m.argument_size_in_bytes/2**30:6.2f}  out {m.output_size_in_bytes/2**30:6.2f}", flush=True)
