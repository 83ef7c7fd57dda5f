#!/bin/bash
# bf16's sweep after the rows-first whole-panel kernel and its fix (b9a7507): the forward, then the input
# gradient on the transposes packed, through ../ragged_dot_packed_f32-cpu-2026-11-29/sweep.sh
# (packed beside kAuto unpacked in one loop, qwen3-30b-a3b with all 128 experts, deepseek-v3
# with --mem-limit-gib 8), from the repository root after `make build`.
D=$(dirname "$0")
M=${M:-/work/main/build/moekit}
S=$D/../ragged_dot_packed_f32-cpu-2026-11-29/sweep.sh
for pass in fwd dlhs; do
  echo "bf16 $pass from $(date -u +%H:%M:%S)" >&2
  M=$M DT=bf16 PASS=$pass "$S" > "$D/sweep-bf16-$pass.txt" 2>&1
done
echo "done at $(date -u +%H:%M:%S)" >&2
