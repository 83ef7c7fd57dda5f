#!/usr/bin/env bash
# Records the expert-parallel exchange of issue 20 under bench/results/ (see record_common.sh):
# qwen3-30b-a3b, bf16, 4096 tokens per rank, on 2 and 4 MPI ranks (4 oversubscribes this 2-core
# machine, and the report says so), a token sweep on 2, and the threads engine on 2.
# Usage: bench/record_dispatch.sh [build-dir]   (about 2 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
op=dispatch
runner=()
runner_shown=
source bench/record_common.sh
allow_mpi_as_root
start_report "Expert-parallel dispatch and combine"

for P in 2 4; do
  runner=(mpiexec -n "$P" --oversubscribe "$tool" bench dispatch)
  runner_shown="mpiexec -n $P --oversubscribe moekit bench dispatch"
  run "qwen3-bf16-4096-mpi-np$P" --preset qwen3-30b-a3b --tokens 4096 --reps 15
done
runner=(mpiexec -n 2 "$tool" bench dispatch)
runner_shown="mpiexec -n 2 moekit bench dispatch"
run qwen3-bf16-sweep-mpi-np2 --preset qwen3-30b-a3b --tokens 256,1024,4096,8192 --reps 9
runner=("$tool" bench dispatch)
runner_shown="moekit bench dispatch"
run qwen3-bf16-4096-threads-2 --preset qwen3-30b-a3b --tokens 4096 --engine threads --ranks 2 \
  --reps 15
echo "wrote $report" >&2
