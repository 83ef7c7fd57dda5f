#!/usr/bin/env bash
# Records the ragged_dot CPU benchmarks of issue 2 under bench/results/: a Markdown report with
# the machine, the date, each command and its table, and the JSON of every run beside it.
# Usage: bench/record_ragged_dot.sh [build-dir]   (takes a few minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
op=ragged_dot
source bench/record_common.sh
start_report "ragged_dot on the CPU"

run qwen3-bf16-4096 --preset qwen3-30b-a3b --tokens 4096 --dtype bf16 --ep-shards 4 --reps 7
run qwen3-f32-4096 --preset qwen3-30b-a3b --tokens 4096 --dtype f32 --ep-shards 4 --reps 7
run qwen3-bf16-sweep --preset qwen3-30b-a3b --tokens 256,512,1024,2048,4096,8192,16384 --reps 5
run mixtral-bf16-64 --preset mixtral-8x7b --tokens 64,512 --reps 5
run deepseek-v3-bf16-512 --preset deepseek-v3 --tokens 512 --reps 3
run presets-bf16-1024 --preset gpt-oss-20b --tokens 1024 --reps 5
echo "wrote $report" >&2
