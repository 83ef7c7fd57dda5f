#!/bin/bash
# The layer forward on packed weights beside unpacked, qwen3-30b-a3b at 1-64 tokens, bf16 then f32
# (issue 35's layer figure), from the repository root after `make build`; after d695b5a.
for dt in bf16 f32; do
  echo "## $dt $(date -u +%H:%M:%S)"
  build/moekit bench layer --preset qwen3-30b-a3b --dtype $dt --tokens 1,8,32,64 --reps 3 \
    --cache-mib 128 --packed-weights
done
