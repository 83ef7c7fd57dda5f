#!/bin/bash
# The bf16 dot products' bound 160 -> 256: before (the tool at 6b8e63c: /tmp/bh/moekit-h, its
# src/cpu/ragged_dot_stream.cpp compiled into a copy of libmoekit.a) and after, kAuto beside oneDNN.
# Usage: ab-dot-bound.sh > ab-dot-bound.txt
for bin in /tmp/bh/moekit-h build/moekit; do
  echo "== $bin bench ragged_dot --dtype bf16 --passes dlhs --baseline onednn --preset deepseek-v3 --tokens 4096 --reps 3 --mem-limit-gib 18"
  $bin bench ragged_dot --dtype bf16 --passes dlhs --baseline onednn --preset deepseek-v3 --tokens 4096 --reps 3 --mem-limit-gib 18 2>/dev/null | grep -E "^ +[0-9]+ +dlhs"
  echo "== $bin bench ragged_dot --dtype bf16 --passes dlhs --baseline onednn --preset qwen3-30b-a3b --tokens 2560,3072 --reps 5"
  $bin bench ragged_dot --dtype bf16 --passes dlhs --baseline onednn --preset qwen3-30b-a3b --tokens 2560,3072 --reps 5 2>/dev/null | grep -E "^ +[0-9]+ +dlhs"
done
