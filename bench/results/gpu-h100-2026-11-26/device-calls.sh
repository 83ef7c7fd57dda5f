#!/usr/bin/env bash
# The four calls of 2026-11-26 on a lent H100 (device tool, .device-pack carried; built here at
# d9a5467 and packed with scripts/device-bundle). 12 minutes of device time in all.

# 1. (273 s) the tests (cut at 170 s: one process; the 4th call ran them again in shards), the
#    ragged_dot bench, the sweep and memcheck. Files: bench-*, sweep-*, memcheck-summary.txt.
STEP_TIMEOUT=170 scripts/device-check tests bench sweep memcheck

# 2. (93 s) each sm90 schedule by name beside kAuto, every preset, 2048-16384 tokens.
#    Files: schedules/.
L=$PWD/.device/lib:/usr/local/cuda/lib64; LD_LIBRARY_PATH=$L .device/bin/moekit --help >/dev/null 2>&1 || L=$PWD/.device/lib-cxx:$L; export LD_LIBRARY_PATH=$L; mkdir -p $OUT/s; t0=$(date +%s); for impl in sm90 sm90-pingpong sm90-cooperative-256; do for p in $(python3 -c 'import json; print(" ".join(p["name"] for p in json.load(open("bench/presets.json"))["presets"]))'); do timeout 40 .device/bin/moekit bench ragged_dot --device cuda --preset $p --tokens 2048,4096,8192,16384 --impl $impl --baseline auto --warmup 2 --reps 10 --mem-limit-gib 70 --json > $OUT/s/$impl-$p.json 2> $OUT/s/$impl-$p.txt; echo "[$(( $(date +%s) - t0 ))s] $impl $p rc $?"; done; done; cd $OUT && tar czf s.tar.gz s && rm -rf s

# 3. (186 s) the layer, router and permute on the GPU; the GPU pytest (cut at 160 s after 51
#    passed). Files: bench-layer-*, bench-router-*, bench-permute-*, pytest-gpu-cut.log.
STEP_TIMEOUT=160 scripts/device-check bench-layer pytest

# 4. (43 s) every GPU test, six shards side by side (what device-check's tests step now does).
#    File: tests-summary.txt.
[ -d .device ] || tar xJf .device-pack/device.tar.xz; L=$PWD/.device/lib:/usr/local/cuda/lib64; LD_LIBRARY_PATH=$L .device/bin/moekit --help >/dev/null 2>&1 || L=$PWD/.device/lib-cxx:$L; export LD_LIBRARY_PATH=$L; t0=$(date +%s); for i in 0 1 2 3 4 5; do GTEST_TOTAL_SHARDS=6 GTEST_SHARD_INDEX=$i timeout 185 .device/bin/moekit_cuda_tests --gtest_brief=1 > $OUT/t$i.log 2>&1 & done; wait; echo "[$(( $(date +%s) - t0 ))s]"; grep -h -E "FAILED|ran\.|PASSED|SKIPPED  \]" $OUT/t*.log; cd $OUT && tar czf t.tar.gz t*.log && rm t*.log
