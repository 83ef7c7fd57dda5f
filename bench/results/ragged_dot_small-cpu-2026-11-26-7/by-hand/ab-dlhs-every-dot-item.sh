#!/bin/bash
# The input gradient's transposed pairs and bound: before (the tool at 8c74391, the commit with the
# forward's slabs: /tmp/bh/moekit-c, its src/cpu/ragged_dot_stream.cpp compiled into a copy of
# libmoekit.a) and after (build/moekit), in turn, each call kAuto beside oneDNN in the same loop.
# Usage: ab-dlhs.sh > ab-dlhs.txt
for round in 1 2; do
  for bin in /tmp/bh/moekit-c build/moekit; do
    for args in "--preset deepseek-v3 --tokens 1024,2048,4096 --reps 3 --mem-limit-gib 18" \
                "--preset qwen3-30b-a3b --tokens 1024,2048,4096 --reps 7" \
                "--preset mixtral-8x7b --tokens 256,512 --reps 5"; do
      echo "== $bin bench ragged_dot --dtype bf16 --passes dlhs --baseline onednn $args"
      $bin bench ragged_dot --dtype bf16 --passes dlhs --baseline onednn $args 2>/dev/null | grep -E "^ +[0-9]+ +dlhs"
    done
    echo "== $bin bench layer --preset qwen3-30b-a3b --tokens 1024,2048 --reps 3"
    $bin bench layer --preset qwen3-30b-a3b --tokens 1024,2048 --reps 3 2>/dev/null | grep -E "^(gmm_up|gmm_down|layer|tokens/s)"
  done
done
