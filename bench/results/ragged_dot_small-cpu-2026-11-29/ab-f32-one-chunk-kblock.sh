#!/bin/bash
# The f32 one-chunk forward's blocks into L2 at about kBlockBytes (128 KiB: 42 of qwen3's 3 KiB
# f32 rows, 16 of deepseek-v3's 8 KiB) instead of L1's 8 rows: a scratch build on top of
# d1c3c2c (MOEKIT_AB=64 in the timed arm), in one loop against the committed blocks, twice.
# speedup = committed / variant.
M=/work/main/build/moekit
for r in 1 2; do
echo "== round $r"
MOEKIT_AB=64 $M bench ragged_dot --preset qwen3-30b-a3b --dtype f32 --passes fwd --tokens 1,4,8,16,32,64,128 --reps 9 --impl stream --baseline stream --cache-mib 128
MOEKIT_AB=64 $M bench ragged_dot --preset deepseek-v3 --dtype f32 --passes fwd --tokens 1,8,32,64 --reps 3 --mem-limit-gib 16 --impl stream --baseline stream --cache-mib 128
MOEKIT_AB=64 $M bench ragged_dot --preset deepseek-v2-lite --matmul up --dtype f32 --passes fwd --tokens 1,8,32 --reps 5 --impl stream --baseline stream --cache-mib 128
done
