#!/usr/bin/env bash
# Second call: the fixed C++ tests, the failing JAX tests with their tracebacks (and the layer's
# again under float32 matmul precision), the ragged_dot GPU tests the first call's cut missed,
# then the JAX layer beside the C++ layer. Logs packed into $OUT after every step.
set -u
final=$OUT
export OUT=/tmp/dc
mkdir -p $OUT
t0=$(date +%s)
tar xJf .devpack/device.tar.xz
pack() { echo "[$(( $(date +%s) - t0 ))s] $1 done"; tar czf "$final/results.tar.gz" -C /tmp dc; }
L=$PWD/.device/lib:/usr/local/cuda/lib64
LD_LIBRARY_PATH=$L timeout 40 .device/bin/moekit_cuda_tests --gtest_brief=1 \
  --gtest_filter='Gpu/PermuteCuda.*:Gpu/RouteCuda.*:PermuteCuda*.*:RouterCuda*.*:SortChunksCuda.*' \
  > $OUT/tests-fixed.log 2>&1; echo "tests rc $?"; tail -4 $OUT/tests-fixed.log; pack tests
export PYTHONPATH=$PWD/.device/python LD_LIBRARY_PATH=$L PYTHONUNBUFFERED=1
k='softmax_pre or (moe_layer and 57 and f32)'
timeout 60 python3 -m pytest -q -rs --tb=short tests/python/test_ops_gpu.py -k "$k" \
  > $OUT/pytest-fail.log 2>&1; echo "pytest rc $?"; grep -E "^E |passed|failed" $OUT/pytest-fail.log | head -40; pack fail
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 40 python3 -m pytest -q --tb=line \
  tests/python/test_ops_gpu.py -k "$k" > $OUT/pytest-highest.log 2>&1; tail -8 $OUT/pytest-highest.log; pack highest
timeout 70 python3 -m pytest -q -rs tests/python/test_ragged_dot_gpu.py > $OUT/pytest-rd.log 2>&1
echo "rd rc $?"; tail -6 $OUT/pytest-rd.log; pack rd
printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$L" "$PWD/.device/bin/moekit" > .device/moekit-run
chmod +x .device/moekit-run
timeout 50 python3 bench/jax_layer.py --preset qwen3-30b-a3b --tokens 4096 --moekit .device/moekit-run \
  --rounds 2 --reps 5 --json > $OUT/jax-layer-qwen3-4096.json 2> $OUT/jax-layer-qwen3-4096.txt
grep -v '^\[' $OUT/jax-layer-qwen3-4096.txt | tail -20; pack jax-layer
