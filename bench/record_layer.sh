#!/usr/bin/env bash
# Records the MoE layer benchmark of issue 6 under bench/results/ (see record_common.sh).
# Usage: bench/record_layer.sh [build-dir]   (about 5 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
op=layer
source bench/record_common.sh
start_report "The MoE layer on the CPU, forward and backward"

# The must-reach case: qwen3-30b-a3b, bf16, 4096 tokens, dropless.
run qwen3-bf16-4096 --preset qwen3-30b-a3b --tokens 4096 --reps 5
# Every preset that fits in memory (the others are named with the reason).
run all-bf16-4096 --preset all --tokens 4096 --reps 3
# deepseek-v2-lite alone: in the all-presets run its shared expert's forward ran at half the
# rate it has in a process of its own (after mixtral's 6 GB of buffers came and went).
run deepseek-v2-lite-bf16-4096 --preset deepseek-v2-lite --tokens 4096 --reps 3
# Capacity mode: tokens past 1.0x the even share are dropped.
run qwen3-bf16-4096-capacity --preset qwen3-30b-a3b --tokens 4096 --capacity-factor 1.0 --reps 3
echo "wrote $report" >&2
