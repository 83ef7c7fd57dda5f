#!/bin/bash
# The forward's kAuto bound by weight-row bytes: each preset around its bound, kCpuStream forced
# and kAuto, each beside oneDNN in the same loop.
cd /work/main
d=bench/results/ragged_dot_small-cpu-2026-11-26-6
for impl in stream auto; do
  for p in qwen3-30b-a3b:1024,2048 olmoe-1b-7b:512,1024 deepseek-v2-lite-bf16:512,1024 deepseek-v3:2048,4096 gpt-oss-20b:512,1024 mixtral-8x7b:128,256,512; do
    preset=${p%%:*}; preset=${preset%-bf16}
    cmd="build/moekit bench ragged_dot --preset $preset --dtype bf16 --tokens ${p##*:} --passes fwd --reps 7 --impl $impl --baseline onednn"
    echo "\$ $cmd" >> $d/fwd-$impl.txt
    $cmd 2>/dev/null >> $d/fwd-$impl.txt
    echo >> $d/fwd-$impl.txt
  done
done
