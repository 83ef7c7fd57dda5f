#!/bin/bash
# This session's sweep after the AMX kernels (d6f985d), run from this folder; the machine quiet
# (no build or bench of ours beside it).
set -x
M=/work/main/build/moekit
date
$M bench ragged_dot --preset qwen3-30b-a3b --dtype bf16 --passes fwd,dlhs --tokens 1,8,32,64,128,256,512,1024,2048,4096 --reps 3 > sweep/tool-qwen3-bf16.txt 2>&1
$M bench ragged_dot --preset deepseek-v3 --dtype bf16 --passes fwd,dlhs --tokens 1,8,32,64,128,256,512,1024 --reps 3 > sweep/tool-dsv3-bf16.txt 2>&1
$M bench ragged_dot --preset qwen3-30b-a3b --dtype f32 --passes fwd,dlhs --tokens 1,8,32,64,128,256,512,1024,2048,4096 --reps 3 > sweep/tool-qwen3-f32.txt 2>&1
$M bench layer --preset all --tokens 1,8,32,64 --reps 3 > sweep/layer-all.txt 2>&1
date
