#!/bin/bash
# The packed kernels' file with its loops aligned to 64 bytes (ALIGNED) against as landed (PLAIN),
# in turn: qwen3-30b-a3b f32 and bf16 forward at 8, 64 and 1024 tokens, deepseek-v3 f32 at 128.
PLAIN=${PLAIN:-build/moekit} ALIGNED=${ALIGNED:-/tmp/new/build/moekit}
for round in ${ROUNDS:-1 2}; do
  for b in PLAIN ALIGNED; do
    echo "## round $round $b $(date -u +%H:%M:%S)"
    for dt in f32 bf16; do
      ${!b} bench ragged_dot --preset qwen3-30b-a3b --dtype $dt --passes fwd --tokens 8,64,1024 \
        --reps 5 --cache-mib 128 --rhs-packed --baseline auto 2>&1 | grep -E "^ +[0-9]+ +fwd" | sed "s/^/qwen3 $dt /"
    done
    ${!b} bench ragged_dot --preset deepseek-v3 --dtype f32 --passes fwd --tokens 128 \
      --reps 5 --cache-mib 128 --rhs-packed --baseline auto 2>&1 | grep -E "^ +[0-9]+ +fwd" | sed "s/^/deepseek f32 /"
  done
done
