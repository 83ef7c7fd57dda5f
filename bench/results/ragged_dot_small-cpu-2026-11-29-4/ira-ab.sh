#!/bin/bash
# Two builds of main at 0353146 in turn: A as committed, B with -fira-region=one on
# ragged_dot_stream.cpp (CMakeLists.txt's COMPILE_OPTIONS of that file). Compute-bound token
# counts, where the 'vs dense' column (the call against a dense oneDNN matmul in the same loop)
# cancels the host's speed between runs.
cd /tmp/ira
for round in 1 2; do
  for b in A B; do
    M=/tmp/moekit$b
    echo "== $b round $round $(date +%T)"
    $M bench ragged_dot --preset qwen3-30b-a3b --dtype bf16 --passes fwd,dlhs --tokens 64,256,512 --reps 5 --cache-mib 128 2>&1 | grep -E "^ +[0-9]+ +(fwd|dlhs)"
    $M bench ragged_dot --preset qwen3-30b-a3b --dtype f32 --passes fwd,dlhs --tokens 64,256,512 --reps 5 --cache-mib 128 2>&1 | grep -E "^ +[0-9]+ +(fwd|dlhs)" | sed 's/^/f32 /'
    $M bench ragged_dot --preset deepseek-v3 --dtype f32 --passes fwd,dlhs --tokens 256,512 --reps 5 --cache-mib 128 --mem-limit-gib 6 2>&1 | grep -E "^ +[0-9]+ +(fwd|dlhs)" | sed 's/^/dsv3f32 /'
  done
done
