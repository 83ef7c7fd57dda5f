#!/bin/bash
# The transposed pairs (input gradient, contraction past 4 KiB, groups past 32 rows): before (the
# tool at 8c74391: /tmp/bh/moekit-c, its src/cpu/ragged_dot_stream.cpp compiled into a copy of
# libmoekit.a) and after (build/moekit), in turn, each call kAuto beside oneDNN in the same loop.
# Usage: ab-dlhs.sh > ab-dlhs.txt
for round in 1 2; do
  for bin in /tmp/bh/moekit-c build/moekit; do
    for args in "--preset gpt-oss-20b --tokens 512,1024,2048 --reps 5" \
                "--preset mixtral-8x7b --tokens 256,512 --reps 5" \
                "--preset deepseek-v3 --tokens 1024,2048 --reps 3 --mem-limit-gib 18"; do
      echo "== $bin bench ragged_dot --dtype bf16 --passes dlhs --baseline onednn $args"
      $bin bench ragged_dot --dtype bf16 --passes dlhs --baseline onednn $args 2>/dev/null | grep -E "^ +[0-9]+ +dlhs"
    done
    echo "== $bin bench layer --preset gpt-oss-20b --tokens 1024 --reps 3"
    $bin bench layer --preset gpt-oss-20b --tokens 1024 --reps 3 2>/dev/null | grep -E "^(gmm_up|gmm_down|layer|tokens/s)"
  done
done
