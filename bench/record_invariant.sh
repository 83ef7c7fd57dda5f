#!/usr/bin/env bash
# Records the batch-invariant mode's cost (issue 25) under bench/results/ (see record_common.sh):
# ragged_dot's three passes and the layer's forward + backward, each beside the default mode in
# the same interleaved loop.
# Usage: bench/record_invariant.sh [build-dir]   (about 3 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
op=invariant
runner=("$build/moekit" bench layer)
runner_shown="moekit bench layer"
source bench/record_common.sh
start_report "The batch-invariant mode's cost on the CPU"

# The must-reach case: the layer, qwen3-30b-a3b, bf16, 4096 tokens (>= 85% of the default's
# forward + backward throughput).
run layer-qwen3-bf16-4096 --preset qwen3-30b-a3b --tokens 4096 --reps 5 --invariant
# f32, and a model with a shared expert and group-limited routing.
run layer-qwen3-f32-4096 --preset qwen3-30b-a3b --tokens 4096 --dtype f32 --reps 3 --invariant
run layer-deepseek-v2-lite-bf16-4096 --preset deepseek-v2-lite --tokens 4096 --reps 3 --invariant
# Small batches (sampling): most experts get a row or none.
run layer-qwen3-bf16-small --preset qwen3-30b-a3b --tokens 1,16,256 --reps 5 --invariant
# ragged_dot alone, over token counts (small batches: the mode's padding of groups under 16 rows).
runner=("$build/moekit" bench ragged_dot)
runner_shown="moekit bench ragged_dot"
run ragged_dot-qwen3-bf16 --preset qwen3-30b-a3b --tokens 16,256,4096 --reps 5 --invariant
echo "wrote $report" >&2
