#!/bin/bash
# After ab-bands.txt: unblocked groups back on one band and the tile's first rows (the fix on
# 4dbc51b, FIXED) against 17143b3's binary (OLD) in turn, two rounds, qwen3-30b-a3b f32 forward.
OLD=${OLD:-/tmp/old/build/moekit} FIXED=${FIXED:-/tmp/moekit-fixed}
for round in 1 2; do
  for b in OLD FIXED; do
    echo "## round $round $b $(date -u +%H:%M:%S)"
    ${!b} bench ragged_dot --preset qwen3-30b-a3b --dtype f32 --passes fwd --tokens 1024,4096 \
      --reps 5 --cache-mib 128 --rhs-packed --baseline auto 2>&1 | grep -E "^ +[0-9]+ +fwd"
  done
done
