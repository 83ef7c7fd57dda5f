"""Times moekit.jax.activation (moekit's C++ kernel through the FFI) against the same formula in
jax.numpy (jax.nn.silu(gate) * up in float32, rounded once: what moekit.jax used before), forward
and forward + backward, on the expert FFN's rows of one layer, and with rows= computing half of
them (the expert-parallel layer on 2 devices, whose static shapes are twice the routed rows).

    .venv/bin/python bench/jax_activation.py [--rows 32768] [--ffn 768] [--kind swiglu]
                                             [--reps 7]

Each case is jitted and compiled first; the median of --reps runs.
"""

import argparse
import os
import statistics

import jax
import jax.numpy as jnp

import moekit.jax as mj
from jax_layer_ep import time_ms  # bench/ is this script's path

FNS = {"swiglu": jax.nn.silu, "geglu": lambda g: jax.nn.gelu(g, approximate=True)}


def median_ms(fn, *args, reps):
    """The median of `reps` timed runs after one untimed (compilation)."""
    return statistics.median(time_ms(fn, args, 1, reps))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--ffn", type=int, default=768, help="F: h is [rows, 2F]")
    ap.add_argument("--kind", choices=sorted(FNS), default="swiglu")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    h = jax.random.normal(jax.random.key(0), (args.rows, 2 * args.ffn)).astype(jnp.bfloat16)
    ct = jax.random.normal(jax.random.key(1), (args.rows, args.ffn)).astype(jnp.bfloat16)

    def xla(h):
        gate, up = jnp.split(h.astype(jnp.float32), 2, axis=-1)
        return (FNS[args.kind](gate) * up).astype(h.dtype)

    impls = {"jax.numpy": xla, "moekit": lambda h: mj.activation(h, args.kind),
             "moekit rows/2": lambda h: mj.activation(h, args.kind, rows=args.rows // 2)}
    print(f"activation {args.kind}, h [{args.rows}, {2 * args.ffn}] bf16, median of "
          f"{args.reps}; {os.cpu_count()} cores")
    print(f"{'impl':>14} {'fwd ms':>8} {'fwd+bwd ms':>11}")
    for name, f in impls.items():
        fwd = median_ms(jax.jit(f), h, reps=args.reps)
        both = median_ms(jax.jit(lambda h, ct: jax.vjp(f, h)[1](ct)), h, ct, reps=args.reps)
        print(f"{name:>14} {fwd:>8.1f} {both:>11.1f}")
    print("fwd+bwd: jax.vjp, the forward and the cotangent's pass.")


if __name__ == "__main__":
    main()
