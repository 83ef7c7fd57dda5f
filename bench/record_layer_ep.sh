#!/usr/bin/env bash
# Records the MoE layer over P ranks (issue 20) under bench/results/ (see record_common.sh):
# qwen3-30b-a3b, bf16, 2 MPI ranks of one thread each beside one rank of two threads on the same
# tokens (2048 and 4096 per rank); the same on the threads engine; deepseek-v2-lite (shared
# experts) on 2 ranks. About 5 minutes on 2 cores.
# Usage: bench/record_layer_ep.sh [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
op=layer-ep
runner=()
runner_shown=
source bench/record_common.sh
allow_mpi_as_root
start_report "The MoE layer over P ranks"

runner=(mpiexec -n 2 "$tool" bench layer)
runner_shown="mpiexec -n 2 moekit bench layer"
run qwen3-bf16-mpi-np2 --ep 2 --preset qwen3-30b-a3b --tokens 2048,4096 --reps 5
run deepseek-v2-lite-bf16-mpi-np2 --ep 2 --preset deepseek-v2-lite --tokens 2048 --reps 3
runner=("$tool" bench layer)
runner_shown="moekit bench layer"
run qwen3-bf16-threads-2 --ep 2 --engine threads --preset qwen3-30b-a3b --tokens 4096 --reps 3
echo "wrote $report" >&2
