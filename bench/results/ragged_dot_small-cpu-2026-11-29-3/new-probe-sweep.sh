#!/bin/bash
# The sweep with the floor's read as the faster of 1 and 4 streams a thread (main at 2e43ebf), run
# from this folder, the machine quiet (nothing of ours beside it).
M=/work/main/build/moekit
T=1,8,32,64,128,256,512,1024,2048,4096
date
$M bench ragged_dot --preset deepseek-v3 --dtype bf16 --passes fwd,dlhs --tokens $T --reps 3 --cache-mib 128 --mem-limit-gib 20 > new-probe-dsv3-bf16.txt 2>&1
$M bench ragged_dot --preset qwen3-30b-a3b --dtype f32 --passes fwd,dlhs --tokens $T --reps 3 --cache-mib 128 > new-probe-qwen3-f32.txt 2>&1
$M bench ragged_dot --preset deepseek-v3 --dtype f32 --passes fwd,dlhs --tokens $T --reps 3 --cache-mib 128 --mem-limit-gib 20 > new-probe-dsv3-f32.txt 2>&1
date
