#!/usr/bin/env bash
# Records issue 35's sweep under bench/results/ (see record_common.sh): ragged_dot's forward and
# input gradient from 1 to 4096 tokens for every preset, each pass against its floor (the weight
# bytes at the read rate, or the FLOPs at the dense rate, both measured in the same run), with the
# weights cold, beside oneDNN's call in the same loop (--baseline onednn: kAuto against what
# ran before kCpuStream); and the layer's forward at 1-64 tokens against its floor.
# Usage: bench/record_ragged_dot_small.sh [build-dir]   (about 40 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
op=ragged_dot_small
runner=("$build/moekit" bench ragged_dot)
runner_shown="moekit bench ragged_dot"
source bench/record_common.sh
start_report "ragged_dot and the layer at the roofline for every batch size (issue 35)"

tokens=1,8,32,64,128,256,512,1024,2048,4096
# The must-reach shapes, bf16 and f32 (deepseek-v3's f32 weights are 15 GB: its own limit).
run qwen3-bf16 --preset qwen3-30b-a3b --dtype bf16 --tokens $tokens --passes fwd,dlhs --reps 5 --baseline onednn
run qwen3-f32 --preset qwen3-30b-a3b --dtype f32 --tokens $tokens --passes fwd,dlhs --reps 3 --baseline onednn
run deepseek-v3-bf16 --preset deepseek-v3 --dtype bf16 --tokens $tokens --passes fwd,dlhs --reps 3 --baseline onednn --mem-limit-gib 18
run deepseek-v3-f32 --preset deepseek-v3 --dtype f32 --tokens $tokens --passes fwd,dlhs --reps 3 --mem-limit-gib 19.5
# The other presets, bf16.
for p in olmoe-1b-7b mixtral-8x7b deepseek-v2-lite gpt-oss-20b; do
  run "$p-bf16" --preset "$p" --dtype bf16 --tokens $tokens --passes fwd,dlhs --reps 3 --baseline onednn
done

# The layer's forward at 1-64 tokens (and 4096, the training batch) against its floor.
runner=("$build/moekit" bench layer)
runner_shown="moekit bench layer"
run layer-qwen3-bf16 --preset qwen3-30b-a3b --tokens 1,8,32,64,4096 --reps 5
run layer-all-bf16 --preset all --tokens 1,8,32,64 --reps 3
echo "wrote $report" >&2
