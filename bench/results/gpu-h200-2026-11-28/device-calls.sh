# The three device calls of 2026-11-28 (the device tool, .device-pack carried; built here with
# `make build && make python && scripts/device-bundle` for call 1, `make build &&
# scripts/device-bundle` for calls 2 and 3, each at the working tree of its rule):
# 1. kAuto = the H100's rule (12b724b): every schedule by name, 2048-65536 tokens -> schedules/
STEP_TIMEOUT=300 scripts/device-check tests schedules
# 2. kAuto = rule A (first H200 rule): other sizes, the sweep, the bench -> check/
SCHEDULE_TOKENS=3072,6144,12288,24576 STEP_TIMEOUT=150 scripts/device-check tests schedules sweep bench
./.device/bin/moekit_cuda_tests --gtest_filter='CudaScheduleRules.Device*'  # (with .device/lib)
# 3. kAuto = rule B (the code): the sweep and 24576 tokens again -> final/
SCHEDULE_TOKENS=24576 STEP_TIMEOUT=120 scripts/device-check tests sweep schedules
