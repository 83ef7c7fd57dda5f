#!/bin/bash
# deepseek-v3 on the same host after bd88c86: sweep.sh's deepseek-v3 part (--mem-limit-gib 8: as
# many of its 256 experts as fit beside the packed copy), forward, f32 then bf16.
D=$(dirname "$0")
M=${M:-/work/main/build/moekit}
S=$D/../ragged_dot_packed_f32-cpu-2026-11-29/sweep.sh
for dt in f32 bf16; do
  echo "deepseek-v3 $dt fwd from $(date -u +%H:%M:%S)" >&2
  M=$M DT=$dt PASS=fwd PRESETS=deepseek-v3 "$S" > "$D/sweep-deepseek-$dt-fwd.txt" 2>&1
done
echo "done at $(date -u +%H:%M:%S)" >&2
