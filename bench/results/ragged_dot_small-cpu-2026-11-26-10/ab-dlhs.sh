#!/bin/sh
# The library's tool before (moekit-old, at 0e1ae36) and after the dot-product shapes
# (moekit-new), in turn, three rounds: the input gradient's share of the floor, bf16 and f32.
for round in 1 2 3; do
  for tool in old new; do
    for preset in qwen3-30b-a3b deepseek-v3; do
      echo "== round $round $tool $preset"
      /tmp/ov/moekit-$tool bench ragged_dot --preset $preset --dtype bf16 --passes dlhs \
        --tokens 1,8,32,64,128,256,512,1024 --reps 5 | grep -E "T=|^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9]+$"
    done
  done
done
