#!/bin/bash
# The input gradient's bound with the transposed pairs (256 rows where stream::long_dot): before
# (/tmp/bh/moekit-c, 8c74391) and after, in turn, kAuto beside oneDNN. Usage: ab-dlhs-bound.sh > ab-dlhs-bound.txt
for round in 1 2; do
  for bin in /tmp/bh/moekit-c build/moekit; do
    for args in "--preset gpt-oss-20b --tokens 1024,2048 --reps 5" "--preset mixtral-8x7b --tokens 512,1024 --reps 5"; do
      echo "== $bin bench ragged_dot --dtype bf16 --passes dlhs --baseline onednn $args"
      $bin bench ragged_dot --dtype bf16 --passes dlhs --baseline onednn $args 2>/dev/null | grep -E "^ +[0-9]+ +dlhs"
    done
  done
done
