#!/bin/bash
# The f32 one-chunk forward's blocks at 2x / 4x their rows (MOEKIT_AB 16 / 32; 16 or 32 rows of
# qwen3's 3 KiB f32 rows, prefetched into L2), a scratch build on top of d1c3c2c, in one loop
# against the committed 8 rows. speedup = committed / variant.
M=/work/main/build/moekit
for r in 1 2; do for v in 16 32; do
echo "== variant $v round $r"
MOEKIT_AB=$v $M bench ragged_dot --preset qwen3-30b-a3b --dtype f32 --passes fwd --tokens 1,4,8,16,32,64 --reps 9 --impl stream --baseline stream --cache-mib 128
done; done
