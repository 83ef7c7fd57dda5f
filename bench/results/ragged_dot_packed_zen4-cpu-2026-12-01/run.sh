#!/bin/bash
# Issue 35's sweep on a Zen 4 host (AVX-512 not exposed by the VM), from the repository root after
# `make build`: the packed forward and input gradient, bf16 and f32, qwen3-30b-a3b and deepseek-v3
# (../ragged_dot_packed_f32-cpu-2026-11-29/sweep.sh: packed beside kAuto unpacked in one loop), then
# the layer forward at 1-64 tokens (../layer_packed-cpu-2026-12-01-2/run.sh's command).
D=$(dirname "$0")
S=$D/../ragged_dot_packed_f32-cpu-2026-11-29/sweep.sh
export M=${M:-build/moekit}
for dt in bf16 f32; do
  DT=$dt PASS=fwd PRESETS=qwen3-30b-a3b "$S" > "$D/$dt-fwd-qwen3.txt" 2>&1
done
for dt in bf16 f32; do
  DT=$dt PASS=fwd PRESETS=deepseek-v3 "$S" > "$D/$dt-fwd-deepseek.txt" 2>&1
done
for dt in bf16 f32; do DT=$dt PASS=dlhs "$S" > "$D/$dt-dlhs.txt" 2>&1; done
for dt in bf16 f32; do
  echo "## $dt $(date -u +%H:%M:%S)"
  $M bench layer --preset qwen3-30b-a3b --dtype $dt --tokens 1,8,32,64 --reps 3 \
    --cache-mib 128 --packed-weights
done > "$D/layer.txt" 2>&1
