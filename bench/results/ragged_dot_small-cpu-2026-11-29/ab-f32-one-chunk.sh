#!/bin/bash
# f32 one-chunk forward (and input gradient) on top of 76411f4: a scratch build (never committed)
# in which the timed arm (every other call) takes MOEKIT_AB's variant and the --baseline arm runs
# as committed: 1 = the whole next block ahead (not half), 2 = blocks of twice the rows,
# 4 = the dot form's whole next super-block (not half). speedup = committed / variant.
M=/work/main/build/moekit
for r in 1 2; do for v in 1 3 4; do
echo "== variant $v round $r"
MOEKIT_AB=$v $M bench ragged_dot --preset qwen3-30b-a3b --dtype f32 --passes fwd,dlhs --tokens 1,2,4,8,16 --reps 9 --impl stream --baseline stream --cache-mib 128
done; done
