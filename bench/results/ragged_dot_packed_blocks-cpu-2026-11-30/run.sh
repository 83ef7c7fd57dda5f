#!/bin/bash
# deepseek-v3 on packed weights after the contraction blocks: sweep.sh's deepseek-v3 part
# (--mem-limit-gib 8), forward f32 and bf16, then the input gradient in f32.
D=$(dirname "$0")
M=${M:-/work/main/build/moekit}
S=$D/../ragged_dot_packed_f32-cpu-2026-11-29/sweep.sh
for dp in f32:fwd bf16:fwd f32:dlhs; do
  dt=${dp%:*} pass=${dp#*:}
  echo "deepseek-v3 $dt $pass from $(date -u +%H:%M:%S)" >&2
  M=$M DT=$dt PASS=$pass PRESETS=deepseek-v3 "$S" > "$D/sweep-deepseek-$dt-$pass.txt" 2>&1
done
echo "done at $(date -u +%H:%M:%S)" >&2
