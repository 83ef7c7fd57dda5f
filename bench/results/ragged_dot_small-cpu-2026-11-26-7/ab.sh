#!/bin/bash
# Before (HEAD's src/cpu/ragged_dot_stream.cpp linked into the same tool: /tmp/bh/moekit-old) and
# after (build/moekit), in turn, each call kAuto beside oneDNN in the same loop.
# Usage: ab.sh > ab.txt
for round in 1 2; do
  for bin in /tmp/bh/moekit-old build/moekit; do
    for args in "--preset deepseek-v3 --tokens 512,1024,2048,4096 --reps 3 --mem-limit-gib 18" \
                "--preset qwen3-30b-a3b --tokens 512,1024,2048,4096 --reps 7" \
                "--preset mixtral-8x7b --tokens 256,512 --reps 5"; do
      echo "== $bin bench ragged_dot --dtype bf16 --passes fwd --baseline onednn $args"
      $bin bench ragged_dot --dtype bf16 --passes fwd --baseline onednn $args 2>/dev/null | grep -E "^ +[0-9]+ +fwd"
    done
    echo "== $bin bench layer --preset qwen3-30b-a3b --tokens 1024,2048 --reps 3"
    $bin bench layer --preset qwen3-30b-a3b --tokens 1024,2048 --reps 3 2>/dev/null | grep -E "^(gmm_up|gmm_down|layer|tokens/s)"
  done
done
