#!/bin/bash
# Blocks of 2x / 4x kBlockBytes (the forward's blocks of several chunks, the dot form's
# super-blocks) now that they are prefetched into L2: a scratch build (never committed) on top of
# d1c3c2c, the timed arm (every other call) with MOEKIT_AB's variant (3: 2x both, 12: 4x both),
# the --baseline arm as committed. speedup = committed / variant.
M=/work/main/build/moekit
for v in 3 12; do
echo "== variant $v"
MOEKIT_AB=$v $M bench ragged_dot --preset qwen3-30b-a3b --dtype bf16 --passes fwd,dlhs --tokens 128,256,512,1024 --reps 7 --impl stream --baseline stream --cache-mib 128
MOEKIT_AB=$v $M bench ragged_dot --preset deepseek-v3 --dtype bf16 --passes fwd,dlhs --tokens 256,512,1024 --reps 3 --mem-limit-gib 20 --impl stream --baseline stream --cache-mib 128
done
