#!/bin/bash
# The next panel's (or block's) prefetch spread over every unit of the current one
# (MOEKIT_AHEAD_SPREAD, a build not landed: spread.diff) against as landed (the first two units
# prefetch it all, a line a step), in turn, the same binary.
BIN=${BIN:-/tmp/new/build/moekit}
for round in ${ROUNDS:-1 2}; do
  for mode in landed spread; do
    echo "## round $round $mode $(date -u +%H:%M:%S)"
    if [ $mode = landed ]; then unset MOEKIT_AHEAD_SPREAD; else export MOEKIT_AHEAD_SPREAD=1; fi
    $BIN bench ragged_dot --preset deepseek-v3 --dtype f32 --passes fwd --tokens 128,256 \
      --reps 5 --cache-mib 128 --rhs-packed --baseline auto 2>&1 | grep -E "^ +[0-9]+ +fwd" | sed "s/^/deepseek f32 /"
    $BIN bench ragged_dot --preset qwen3-30b-a3b --dtype f32 --passes fwd --tokens 64,1024 \
      --reps 5 --cache-mib 128 --rhs-packed --baseline auto 2>&1 | grep -E "^ +[0-9]+ +fwd" | sed "s/^/qwen3 f32 /"
  done
done
