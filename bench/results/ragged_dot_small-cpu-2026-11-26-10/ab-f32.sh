#!/bin/sh
# The tool at 3ce18f8 (moekit-new: the bf16 shapes) and after the f32 shapes (moekit-f32), in
# turn, three rounds: the f32 input gradient's share of the floor.
for round in 1 2 3; do
  for tool in new f32; do
    for preset in qwen3-30b-a3b deepseek-v3; do
      echo "== round $round $tool $preset"
      /tmp/ov/moekit-$tool bench ragged_dot --preset $preset --dtype f32 --passes dlhs \
        --tokens 1,8,32,64,128,256 --reps 5 | grep -E "T=|^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9]+$|subset|experts"
    done
  done
done
