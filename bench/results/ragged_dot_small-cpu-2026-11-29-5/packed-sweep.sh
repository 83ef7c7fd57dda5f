#!/bin/bash
# The forward on packed weights (--rhs-packed) against the same weights unpacked, kAuto (--baseline
# auto), in one loop, every token count; the layer's gate|up and down shapes.
M=/work/main/build/moekit
for preset in qwen3-30b-a3b mixtral-8x7b gpt-oss-20b; do
  for mm in up down; do
    echo "## $preset $mm"
    $M bench ragged_dot --preset $preset --matmul $mm --dtype bf16 --passes fwd --tokens 1,8,32,64,128,512,2048 \
      --reps 5 --cache-mib 128 --rhs-packed --baseline auto 2>&1 | grep -E "^ +[0-9]+ +fwd"
  done
done
echo "## deepseek-v3 up (--mem-limit-gib 6)"
$M bench ragged_dot --preset deepseek-v3 --matmul up --dtype bf16 --passes fwd --tokens 1,8,32,64,128,512,2048 \
  --reps 5 --cache-mib 128 --rhs-packed --baseline auto --mem-limit-gib 6 2>&1 | grep -E "^ +[0-9]+ +fwd|note"
