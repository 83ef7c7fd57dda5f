#!/bin/bash
# Peak resident memory of the JAX bench scripts as the pytest suite runs them, and the tiny
# ragged_dot case's times warmed and not, from the repository root (.venv and build/ made).
peak() { /usr/bin/time -v "$@" 2>&1 >/dev/null | grep -E "Maximum resident|Elapsed"; }
for l in kn nk; do
  echo "## jax_ragged_dot.py at qwen3-30b-a3b, --rhs-layout $l"
  peak .venv/bin/python bench/jax_ragged_dot.py --tokens 2 --reps 1 --impls moekit,masked \
    --shards 1,4 --rhs-layout $l --json
done
echo "## jax_ragged_dot.py --dims 40,24,8,8 (the test's case), nk"
peak .venv/bin/python bench/jax_ragged_dot.py --tokens 2 --reps 1 --impls moekit,masked \
  --shards 1,4 --rhs-layout nk --dims 40,24,8,8 --json
echo "## jax_layer.py, test_layer.py's two cases"
peak .venv/bin/python bench/jax_layer.py --preset olmoe-1b-7b --tokens 4 \
  --impls moekit,steps,lax,cpp --rounds 1 --reps 1 --warmup 0 --json
peak .venv/bin/python bench/jax_layer.py --preset olmoe-1b-7b --tokens 3 --packed-weights \
  --rounds 1 --reps 1 --warmup 0 --json
echo "## the tiny case's times: 1 rep after 1 warm-up, then 20 after 3"
.venv/bin/python bench/jax_ragged_dot.py --tokens 2 --reps 1 --warmup 1 --impls moekit,lax \
  --shards 1 --dims 40,24,8,8 2>&1 | tail -5
.venv/bin/python bench/jax_ragged_dot.py --tokens 2 --reps 20 --warmup 3 --impls moekit,lax \
  --shards 1 --dims 40,24,8,8 2>&1 | tail -5
