#!/bin/bash
# qwen3-30b-a3b f32 forward on packed weights (not blocked: 256 KiB panels), 17143b3's binary
# (OLD, a worktree built beside) against 4dbc51b's (NEW: bands of 64 rows, the tile's rows per
# chunk) in turn, two rounds: is the sweep's 0.93-0.96x at 1024-4096 tokens the change or the host?
OLD=${OLD:-/tmp/old/build/moekit} NEW=${NEW:-/work/main/build/moekit}
for round in 1 2; do
  for b in OLD NEW; do
    echo "## round $round $b $(date -u +%H:%M:%S)"
    ${!b} bench ragged_dot --preset qwen3-30b-a3b --dtype ${DT:-f32} --passes fwd --tokens ${T:-1024,2048,4096} \
      --reps 5 --cache-mib 128 --rhs-packed --baseline auto 2>&1 | grep -E "^ +[0-9]+ +fwd"
  done
done
