#!/bin/bash
# After ab-long-halves.sh: f32 only at 8 and 16 rows a group (256, 512 tokens), three rounds,
# MOEKIT_LONG_HALVES_FROM unset (as landed) against 3, in turn, the same binary (build.diff).
BIN=${BIN:-/tmp/new/build/moekit}
for round in 1 2 3; do
  for from in landed 3; do
    echo "## round $round from=$from $(date -u +%H:%M:%S)"
    if [ $from = landed ]; then unset MOEKIT_LONG_HALVES_FROM; else export MOEKIT_LONG_HALVES_FROM=$from; fi
    $BIN bench ragged_dot --preset deepseek-v3 --dtype f32 --passes fwd --tokens 256,512 \
      --reps 5 --cache-mib 128 --rhs-packed --baseline auto 2>&1 | grep -E "^ +[0-9]+ +fwd"
  done
done
