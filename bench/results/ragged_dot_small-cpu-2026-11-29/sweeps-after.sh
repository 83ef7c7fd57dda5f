#!/bin/bash
# The session's sweep after the prefetch change (main at 76411f4), run from this folder, the machine
# quiet (no build or bench of ours beside it).
set -x
M=/work/main/build/moekit
T=1,8,32,64,128,256,512,1024,2048,4096
date
$M bench ragged_dot --preset qwen3-30b-a3b --dtype bf16 --passes fwd,dlhs --tokens $T --reps 3 --cache-mib 128 > after-tool-qwen3-bf16.txt 2>&1
$M bench ragged_dot --preset deepseek-v3 --dtype bf16 --passes fwd,dlhs --tokens $T --reps 3 --cache-mib 128 --mem-limit-gib 20 > after-tool-dsv3-bf16.txt 2>&1
$M bench ragged_dot --preset qwen3-30b-a3b --dtype f32 --passes fwd,dlhs --tokens $T --reps 3 --cache-mib 128 > after-tool-qwen3-f32.txt 2>&1
$M bench layer --preset all --tokens 1,8,32,64 --reps 3 --cache-mib 128 > after-layer-all.txt 2>&1
date
