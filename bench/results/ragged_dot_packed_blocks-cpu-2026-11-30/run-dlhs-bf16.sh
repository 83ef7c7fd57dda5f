#!/bin/bash
# deepseek-v3's input gradient in bf16 on the transposes packed, at 4dbc51b: sweep.sh's
# deepseek-v3 part (--mem-limit-gib 8).
D=$(dirname "$0")
M=${M:-/work/main/build/moekit}
M=$M DT=bf16 PASS=dlhs PRESETS=deepseek-v3 "$D/../ragged_dot_packed_f32-cpu-2026-11-29/sweep.sh" \
  > "$D/sweep-deepseek-bf16-dlhs.txt" 2>&1
