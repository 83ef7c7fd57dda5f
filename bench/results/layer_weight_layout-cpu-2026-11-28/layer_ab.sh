#!/bin/bash
# The layer on both expert-weight layouts, one after the other, twice (the order swapped).
cd /work/main
out=bench/results/layer_weight_layout-cpu-2026-11-28
for preset in mixtral-8x7b qwen3-30b-a3b; do
  for round in 1 2; do
    if [ $round = 1 ]; then order="default transposed"; else order="transposed default"; fi
    for layout in $order; do
      flag=""; [ $layout = transposed ] && flag="--expert-weights-transposed"
      echo "== $preset round $round $layout"
      ./build/moekit bench layer --preset $preset --tokens 1,8,32,64,256 --cache-mib 128 --reps 5 $flag \
        > $out/$preset-$layout-$round.txt 2>&1
    done
  done
done
echo done
