#!/bin/sh
# qwen3-30b-a3b, bf16 and f32, forward and input gradient, 1-4096 tokens, kAuto: the tool before
# this session's changes (0a33325, "old") and after (eb08e55, "new") in turn, two rounds.
# Usage: sweep.sh OLD_TOOL NEW_TOOL
for dtype in bf16 f32; do
  for round in 1 2; do
    for t in old new; do
      tool=$1; [ $t = new ] && tool=$2
      echo "== round $round $t $dtype"
      $tool bench ragged_dot --preset qwen3-30b-a3b --dtype $dtype --passes fwd,dlhs \
        --tokens 1,8,32,64,128,256,512,1024,4096 --reps 3 2>&1 | grep -v "^\["
    done
  done
done
