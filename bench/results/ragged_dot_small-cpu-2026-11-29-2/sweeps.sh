#!/bin/bash
# The sweep after the one-chunk pair blocks (main at 67865b5), run from this folder, the machine
# quiet (no build or bench of ours beside it). f32 left out: its kernels did not change.
set -x
M=/work/main/build/moekit
T=1,8,32,64,128,256,512,1024,2048,4096
date
$M bench ragged_dot --preset qwen3-30b-a3b --dtype bf16 --passes fwd,dlhs --tokens $T --reps 3 --cache-mib 128 > tool-qwen3-bf16.txt 2>&1
$M bench ragged_dot --preset deepseek-v3 --dtype bf16 --passes fwd,dlhs --tokens $T --reps 3 --cache-mib 128 --mem-limit-gib 20 > tool-dsv3-bf16.txt 2>&1
$M bench layer --preset all --tokens 1,8,32,64 --reps 3 --cache-mib 128 > layer-all.txt 2>&1
date
