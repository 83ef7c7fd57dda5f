#!/bin/bash
# The prefetch level's A/B in one loop: a scratch build (never committed) in which every other
# kCpuStream call prefetches every block into L1 as before (the --baseline arm), the others by
# prefetch_into_l1 (the timed arm): speedup = before / after.
M=/work/main/build/moekit
A="--impl stream --baseline stream --cache-mib 128"
T=1,8,32,64,128,256,512,1024
for r in 1 2; do
date
$M bench ragged_dot --preset qwen3-30b-a3b --dtype bf16 --passes fwd,dlhs --tokens $T --reps 7 $A
$M bench ragged_dot --preset deepseek-v3 --dtype bf16 --passes fwd,dlhs --tokens $T --reps 3 --mem-limit-gib 20 $A
$M bench ragged_dot --preset qwen3-30b-a3b --dtype f32 --passes fwd,dlhs --tokens $T --reps 5 $A
done
for p in mixtral-8x7b gpt-oss-20b olmoe-1b-7b deepseek-v2-lite; do
$M bench ragged_dot --preset $p --matmul up --dtype bf16 --passes fwd,dlhs --tokens 1,8,32,64,256 --reps 3 $A
done
date
