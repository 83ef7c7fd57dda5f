#!/usr/bin/env bash
# Records the permutation CPU benchmarks of issue 4 under bench/results/ (see record_common.sh).
# Usage: bench/record_permute.sh [build-dir]   (under a minute on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
op=permute
source bench/record_common.sh
start_report "Permutation on the CPU"

run qwen3-bf16-4096 --preset qwen3-30b-a3b --tokens 4096 --dtype bf16 --reps 15
run qwen3-f32-4096 --preset qwen3-30b-a3b --tokens 4096 --dtype f32 --reps 9
echo "wrote $report" >&2
