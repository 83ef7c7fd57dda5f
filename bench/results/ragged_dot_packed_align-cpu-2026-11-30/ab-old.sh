#!/bin/bash
# qwen3-30b-a3b f32 forward, 17143b3's binary (OLD) against main's (NEW) in turn, four rounds.
OLD=${OLD:-/tmp/old/build/moekit} NEW=${NEW:-build/moekit}
for round in ${ROUNDS:-1 2 3 4}; do
  for b in OLD NEW; do
    echo "## round $round $b $(date -u +%H:%M:%S)"
    ${!b} bench ragged_dot --preset qwen3-30b-a3b --dtype f32 --passes fwd --tokens 1024,4096 \
      --reps 5 --cache-mib 128 --rhs-packed --baseline auto 2>&1 | grep -E "^ +[0-9]+ +fwd"
  done
done
