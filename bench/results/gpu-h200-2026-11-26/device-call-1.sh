#!/usr/bin/env bash
# One call on the lent GPU: unpack the bundle, then each step under its own timeout, the logs
# packed into $OUT after every step (so a cut still brings back what ran).
set -u
final=$OUT
export OUT=/tmp/dc
mkdir -p $OUT
t0=$(date +%s)
tar xJf .devpack/device.tar.xz
pack() { echo "[$(( $(date +%s) - t0 ))s] $1 done"; tar czf "$final/results.tar.gz" -C /tmp dc; }
python3 -c 'import jax; print(jax.__version__, jax.devices())' > $OUT/jax.txt 2>&1
timeout 220 scripts/device-check tests; pack tests
timeout 110 scripts/device-check bench-layer; pack bench-layer
export PYTHONPATH=$PWD/.device/python LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64
timeout 90 python3 -m pytest -q -rs tests/python/test_ops_gpu.py tests/python/test_ragged_dot_gpu.py \
  > $OUT/pytest-gpu.log 2>&1; echo "pytest rc $?"; tail -15 $OUT/pytest-gpu.log; pack pytest
unset PYTHONPATH LD_LIBRARY_PATH
timeout 90 scripts/device-check memcheck; pack memcheck
LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 timeout 60 .device/bin/moekit bench ragged_dot \
  --device cuda --dtype bf16 --preset qwen3-30b-a3b --tokens 4096,16384 --ep-shards 4 --warmup 5 \
  --reps 30 --mem-limit-gib 60 --json > $OUT/bench-qwen3-bf16.json 2> $OUT/bench-qwen3-bf16.txt
tail -14 $OUT/bench-qwen3-bf16.txt; pack bench
