#!/bin/bash
# In one loop: timed arm MOEKIT_AB (2: the next item's first block prefetched only up to the
# current item's block rows; 0: the change as is), baseline arm MOEKIT_AB_BASE (0 or 1: before the change).
M=/work/main/build/moekit
f() { grep -E '^ +[0-9]+ +(fwd|dlhs) ' | awk '{print $1, $2, $4, $5, $(NF-2), $(NF-1)}'; }
for r in 1 2; do
for pair in "2 0" "0 1"; do set -- $pair
  for mm in ffn up down; do
    echo "== r$r AB=$1 vs BASE=$2 qwen3 $mm routed ($(date +%T))"
    MOEKIT_AB=$1 MOEKIT_AB_BASE=$2 $M bench ragged_dot --preset qwen3-30b-a3b --matmul $mm --dtype bf16 --passes fwd --tokens 24,32,40 --reps 9 --cache-mib 128 --impl stream --baseline stream 2>&1 | f
  done
done; done
