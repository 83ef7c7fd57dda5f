#!/bin/bash
# moekitA: ragged_dot_stream.cpp at -O3 (GCC 12's default regions); moekitB: with -fira-region=one. Separate runs in turn.
for r in 1 2 3; do
  for x in A B; do
    for dt in bf16 f32; do
      echo "== $x r$r $dt $(date +%T)"
      ./moekit$x bench ragged_dot --preset qwen3-30b-a3b --dtype $dt --passes fwd,dlhs --tokens 32,64,128,256 --reps 5 --cache-mib 128 2>&1 | grep -E '^ +[0-9]+ +(fwd|dlhs) ' | awk '{print $1, $2, $5, $(NF-1)}'
    done
  done
done
