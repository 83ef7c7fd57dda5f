#!/usr/bin/env bash
# moekit.jax.moe_layer's forward on packed experts' weights beside the C++ layer's (moekit bench
# layer --packed-weights), each preset at 1, 8, 32 and 64 tokens, bf16, one process per
# (preset, tokens). From the repository root, after `make build && make python`.
set -euo pipefail
for preset in qwen3-30b-a3b mixtral-8x7b gpt-oss-20b olmoe-1b-7b; do
  for tokens in 1 8 32 64; do
    echo "== $preset $tokens" >&2
    .venv/bin/python bench/jax_layer.py --preset "$preset" --tokens "$tokens" --packed-weights \
      --rounds 5 --reps 5 --warmup 2 --json
  done
done
