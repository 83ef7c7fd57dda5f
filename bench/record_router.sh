#!/usr/bin/env bash
# Records the router CPU benchmarks of issue 3 under bench/results/ (see record_common.sh).
# Usage: bench/record_router.sh [build-dir]   (about a minute on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
op=router
source bench/record_common.sh
start_report "Router and losses on the CPU"

run deepseek-v3-f32-16384 --preset deepseek-v3 --tokens 16384 --reps 21
run qwen3-f32-16384 --preset qwen3-30b-a3b --tokens 16384 --reps 21
run deepseek-v3-bf16-16384 --preset deepseek-v3 --tokens 16384 --dtype bf16 --reps 21
# One thread: the cost per token of the per-row work, without the second core.
OMP_NUM_THREADS=1 run deepseek-v3-f32-16384-1thread --preset deepseek-v3 --tokens 16384 --reps 11
run qwen3-f32-sweep --preset qwen3-30b-a3b --tokens 1024,4096,16384,65536 --reps 11
echo "wrote $report" >&2
