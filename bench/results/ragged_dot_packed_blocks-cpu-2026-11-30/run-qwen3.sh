#!/bin/bash
# qwen3-30b-a3b on packed weights after 5d3663e (its panels are not blocked; the bands of 64 rows
# and the tile's rows are new on this path): sweep.sh's qwen3-30b-a3b part, forward f32 and bf16.
D=$(dirname "$0")
M=${M:-/work/main/build/moekit}
S=$D/../ragged_dot_packed_f32-cpu-2026-11-29/sweep.sh
for dt in f32 bf16; do
  echo "qwen3-30b-a3b $dt fwd from $(date -u +%H:%M:%S)" >&2
  M=$M DT=$dt PASS=fwd PRESETS=qwen3-30b-a3b "$S" > "$D/sweep-qwen3-$dt-fwd.txt" 2>&1
done
echo "done at $(date -u +%H:%M:%S)" >&2
