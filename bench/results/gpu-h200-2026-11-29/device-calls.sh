# The three device calls of 2026-11-29 (the device tool, .device-pack carried), all at da01cc4,
# built here with `make build && make python && scripts/device-bundle`. One machine, kept warm
# between the calls: its work folder (/tmp/device-check) gathered all three, returned as check/.
# 1. tests, the 64x256 pingpong schedule by name beside kAuto, Nsight Compute on the GEMMs, JAX
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $OUT/gpu.txt
STEP_TIMEOUT=150 SCHEDULE_IMPLS=sm90-pingpong-64x256 SCHEDULE_TOKENS=1024,2048,4096,8192,16384 \
  scripts/device-check tests schedules profile-gemm pytest
# 2. the C++ layer, issue 7's shapes and every preset at 4096 tokens, memcheck
STEP_TIMEOUT=150 scripts/device-check bench-layer bench memcheck
# 3. moekit.jax beside the C++ layer and beside jax.lax.ragged_dot, then the sweep (512-65536)
STEP_TIMEOUT=150 scripts/device-check jax-layer jax-bench sweep
# Tables, from the repository root:
python3 bench/schedules_table.py bench/results/gpu-h200-2026-11-29/check \
  > bench/results/gpu-h200-2026-11-29/schedules-table.txt
python3 bench/sweep_table.py bench/results/gpu-h200-2026-11-29/check \
  bench/results/gpu-h200-2026-11-28/final > bench/results/gpu-h200-2026-11-29/sweep-table.txt
