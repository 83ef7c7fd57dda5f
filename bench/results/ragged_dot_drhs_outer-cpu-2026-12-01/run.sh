#!/bin/bash
# The weight gradient at 1-512 tokens: kAuto (the outer-product sums up to 16 rows a group, oneDNN
# past them) against oneDNN in the same loop (--baseline onednn); then the layer at 1-64 tokens.
M=${M:-build/moekit}
D=${D:-.}
for dt in bf16 f32; do
  for preset in qwen3-30b-a3b deepseek-v3; do
    limit=$([ $preset = deepseek-v3 ] && echo "--mem-limit-gib 12")
    echo "## $preset drhs $dt $limit"
    $M bench ragged_dot --preset $preset --dtype $dt --passes drhs --tokens 1,8,32,64,128,256,512 \
      --reps 3 --baseline onednn $limit 2>&1 | grep -E "^ +[0-9]+ +drhs|note|tokens +pass"
  done
done > "$D/drhs.txt"
for dt in bf16 f32; do
  echo "## $dt $(date -u +%H:%M:%S)"
  $M bench layer --preset qwen3-30b-a3b --dtype $dt --tokens 1,8,32,64 --reps 3 --cache-mib 128
done > "$D/layer.txt" 2>&1
