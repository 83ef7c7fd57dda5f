#!/usr/bin/env bash
# Records bench/jax_ragged_dot.py (issue 5) under bench/results/ (see record_common.sh), with the
# C++ bench of the same case first as the reference. Usage: bench/record_jax_ragged_dot.sh
# [build-dir]. About 5 minutes on 2 cores: XLA's own CPU ragged_dot computes E times the work.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
op=jax_ragged_dot
source bench/record_common.sh
start_report "ragged_dot inside JAX on the CPU (jax $(.venv/bin/python -c 'import jax; print(jax.__version__)'))"

# The reference for the must-reach figure: the C++ bench of the same case.
runner=("$tool" bench ragged_dot)
runner_shown="moekit bench ragged_dot"
run cpp-4096 --preset qwen3-30b-a3b --tokens 4096 --ep-shards 4 --reps 5
runner=(.venv/bin/python bench/jax_ragged_dot.py)
runner_shown="python bench/jax_ragged_dot.py"
# moekit alone at 4096 tokens: the full call, shard 0 of 4, and all 4 shards under shard_map.
run moekit-4096 --preset qwen3-30b-a3b --tokens 4096 --shards 1,4 --reps 5
# XLA's ragged_dot and the masking workaround, at 64 tokens. XLA's CPU ragged_dot builds an f32
# [E, m, K] operand: at 4096 tokens it asks for 35 GB ("Out of memory allocating 35265708032
# bytes" on this 23 GiB machine); at 256 tokens the backward passes and the 4 devices' copies
# got the process killed for memory.
run all-64 --preset qwen3-30b-a3b --tokens 64 --shards 1,4 --impls moekit,lax,masked --reps 1
echo "wrote $report" >&2
