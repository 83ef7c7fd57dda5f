#!/bin/bash
# The layer on both expert-weight layouts against the 4-stream read probe (a438946), once each.
cd /work/main
out=bench/results/layer_weight_layout-cpu-2026-11-28
for preset in mixtral-8x7b qwen3-30b-a3b; do
  for layout in default transposed; do
    flag=""; [ $layout = transposed ] && flag="--expert-weights-transposed"
    echo "== $preset $layout"
    ./build/moekit bench layer --preset $preset --tokens 1,8,32,64,256 --cache-mib 128 --reps 3 $flag \
      > $out/probe4-$preset-$layout.txt 2>&1
  done
done
echo done
