#!/bin/sh
# The state at the end of the session: forward and input gradient, bf16 and f32, qwen3-30b-a3b and
# deepseek-v3, 1-4096 tokens, share of the floor (deepseek-v3 in f32 with the 20 GiB its weights
# need, to 1024 tokens).
for dtype in bf16 f32; do
  for preset in qwen3-30b-a3b deepseek-v3; do
    limit=""; tokens=1,8,32,64,128,256,512,1024,4096
    if [ $dtype = f32 ] && [ $preset = deepseek-v3 ]; then limit="--mem-limit-gib 20"; tokens=1,8,32,64,128,256,512,1024; fi
    echo "== $preset $dtype"
    ../../../build/moekit bench ragged_dot --preset $preset --dtype $dtype --passes fwd,dlhs \
      --tokens $tokens --reps 5 $limit 2>&1 | grep -v "^\["
  done
done
