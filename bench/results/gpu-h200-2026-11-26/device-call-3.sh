#!/usr/bin/env bash
# Third call: the router / loss / permute GPU tests, then moekit.jax's GPU op tests (the NaN-row
# losses, the f32 layer at "highest", softmax pre with the CPU's NaN fix), then the ragged_dot
# GPU tests. Logs packed into $OUT after every step.
set -u
final=$OUT
export OUT=/tmp/dc
mkdir -p $OUT
t0=$(date +%s)
tar xJf .devpack/device.tar.xz
pack() { echo "[$(( $(date +%s) - t0 ))s] $1 done"; tar czf "$final/results.tar.gz" -C /tmp dc; }
L=$PWD/.device/lib:/usr/local/cuda/lib64
LD_LIBRARY_PATH=$L timeout 30 .device/bin/moekit_cuda_tests --gtest_brief=1 \
  --gtest_filter='Gpu/PermuteCuda.*:*RouteCuda*.*:*RouterCuda*.*:LossesCuda.*:AuxScoresCuda.*:SortChunksCuda.*' \
  > $OUT/tests-3.log 2>&1; echo "tests rc $?"; tail -3 $OUT/tests-3.log; pack tests
export PYTHONPATH=$PWD/.device/python LD_LIBRARY_PATH=$L PYTHONUNBUFFERED=1
timeout 130 python3 -m pytest -q -rs --tb=short tests/python/test_ops_gpu.py > $OUT/pytest-ops.log 2>&1
echo "ops rc $?"; grep -E "^E |passed|failed" $OUT/pytest-ops.log | head -30; pack ops
timeout 130 python3 -m pytest -q -rs --tb=short tests/python/test_ragged_dot_gpu.py > $OUT/pytest-rd.log 2>&1
echo "rd rc $?"; grep -E "^E |passed|failed" $OUT/pytest-rd.log | head -20; tail -c 300 $OUT/pytest-rd.log; pack rd
