#!/bin/bash
# The input gradient on the weights' transposes packed (--rhs-packed --passes dlhs: frozen
# weights, a second packed copy) against kAuto on the same weights unpacked ([E, K, n]), in one
# loop per token count, the shapes (--matmul ffn), bf16 and f32.
M=${M:-/work/main/build/moekit}
T=1,8,32,64,128,256,512,1024,4096
for dt in f32 bf16; do
  echo "## qwen3-30b-a3b ffn $dt dlhs"
  $M bench ragged_dot --preset qwen3-30b-a3b --dtype $dt --passes dlhs --tokens $T \
    --reps 5 --cache-mib 128 --rhs-packed --baseline auto 2>&1 | grep -E "^ +[0-9]+ +dlhs|note"
  echo "## deepseek-v3 ffn $dt dlhs (--mem-limit-gib 8)"
  $M bench ragged_dot --preset deepseek-v3 --dtype $dt --passes dlhs --tokens $T \
    --reps 5 --cache-mib 128 --rhs-packed --baseline auto --mem-limit-gib 8 2>&1 | grep -E "^ +[0-9]+ +dlhs|note: T"
done
