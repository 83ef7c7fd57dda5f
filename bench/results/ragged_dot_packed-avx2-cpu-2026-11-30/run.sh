#!/bin/bash
# Issue 35 on AVX2 after bd88c86 (groups of many rows over each half of a packed panel): the
# commands of ../cpu-avx2-zen3-2026-11-30/run.sh (taken before it, same host kind), qwen3-30b-a3b:
# ragged_dot on packed weights beside kAuto on the same weights unpacked in one loop, forward and
# input gradient, f32 and bf16; then the layer forward on packed weights at 1-64 tokens.
D=$(dirname "$0")
M=${M:-/work/main/build/moekit}
S=$D/../ragged_dot_packed_f32-cpu-2026-11-29/sweep.sh
lscpu > "$D/lscpu.txt"
for run in "f32 fwd" "bf16 fwd" "f32 dlhs" "bf16 dlhs"; do
  set -- $run
  echo "$run from $(date -u +%H:%M:%S)" >&2
  M=$M DT=$1 PASS=$2 PRESETS=qwen3-30b-a3b "$S" > "$D/sweep-$1-$2.txt" 2>&1
done
echo "layer from $(date -u +%H:%M:%S)" >&2
$M bench layer --preset qwen3-30b-a3b --tokens 1,8,32,64 --reps 3 --cache-mib 128 \
  --packed-weights > "$D/layer-qwen3-bf16.txt" 2>&1
echo "done at $(date -u +%H:%M:%S)" >&2
