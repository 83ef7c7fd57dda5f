#!/bin/bash
# The input gradient on the transposes packed, DT (f32 or bf16), after 1c03454: sweep.sh with PASS=dlhs.
D=$(dirname "$0")
M=${M:-/work/main/build/moekit}
S=$D/../ragged_dot_packed_f32-cpu-2026-11-29/sweep.sh
echo "${DT:-f32} dlhs from $(date -u +%H:%M:%S)" >&2
M=$M DT=${DT:-f32} PASS=dlhs "$S" > "$D/sweep-${DT:-f32}-dlhs.txt" 2>&1
echo "done at $(date -u +%H:%M:%S)" >&2
