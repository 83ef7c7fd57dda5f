#!/usr/bin/env bash
# Records bench/jax_layer.py (issue 33) under bench/results/ (see record_common.sh):
# moekit.jax.moe_layer (fused, its default on the CPU) beside the C++ layer at every preset that
# fits, bf16, 4096 tokens, forward and forward + backward. One process per preset, the JAX layer
# and the C++ one alone in it (another JAX layer timed between the rounds leaves the heap laid
# out for itself, and the next round faults in pages afresh: olmoe-1b-7b read 1.11x beside the
# steps, 1.02x alone). Where the JAX and the C++ processes together would not fit in memory
# (mixtral-8x7b on 24 GiB), each runs in processes of its own, alternating, three rounds; the
# summary takes the median of those rounds. About 25 minutes on 2 cores.
# Usage: bench/record_jax_layer.sh
set -euo pipefail
cd "$(dirname "$0")/.."
build=build
op=jax_layer
runner=(.venv/bin/python bench/jax_layer.py)
runner_shown="python bench/jax_layer.py"
source bench/record_common.sh
start_report "moekit.jax moe_layer beside the C++ layer at every preset (jax $(.venv/bin/python -c 'import jax; print(jax.__version__)'))"
common=(--tokens 4096 --rounds 3 --reps 3 --warmup 2)
for p in qwen3-30b-a3b deepseek-v2-lite gpt-oss-20b olmoe-1b-7b deepseek-v3; do
  run "$p" --preset "$p" --impls moekit,cpp "${common[@]}"
done
for r in 1 2 3; do
  for i in moekit cpp; do
    run "mixtral-8x7b-$i-$r" --preset mixtral-8x7b --impls $i --tokens 4096 --rounds 1 --reps 3 \
      --warmup 2
  done
done
{
  echo "## Summary: moekit.jax / C++ (each preset's median over its rounds)"
  echo
  echo '```'
  .venv/bin/python bench/summarize_jax_layer.py "$out"
  echo '```'
} >>"$report"
echo "wrote $report" >&2
