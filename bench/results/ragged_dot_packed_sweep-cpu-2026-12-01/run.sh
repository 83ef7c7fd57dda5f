#!/bin/bash
# The packed forward's sweep after the 3-row f32 chunks and the spread prefetch (1c03454):
# ../ragged_dot_packed_f32-cpu-2026-11-29/sweep.sh (packed beside kAuto unpacked in one loop,
# qwen3-30b-a3b with all 128 experts, deepseek-v3 with --mem-limit-gib 8), f32 then bf16.
D=$(dirname "$0")
M=${M:-/work/main/build/moekit}
S=$D/../ragged_dot_packed_f32-cpu-2026-11-29/sweep.sh
for dt in f32 bf16; do
  echo "$dt from $(date -u +%H:%M:%S)" >&2
  M=$M DT=$dt PASS=fwd "$S" > "$D/sweep-$dt-fwd.txt" 2>&1
done
echo "done at $(date -u +%H:%M:%S)" >&2
