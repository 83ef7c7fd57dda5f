#!/bin/bash
# The session's recorded sweeps, one after another after quiet.sh (the build at HEAD when run: f5cf2e7 for sweeps-1/, 88b5490 for sweeps-2/, 9cc7afc for sweeps-3/; each run moved its outputs there).
set -x
M=/work/main/build/moekit
bash ../ragged_dot_small-cpu-2026-11-27-3/quiet.sh
date
$M bench ragged_dot --preset qwen3-30b-a3b --dtype bf16 --passes fwd,dlhs --tokens 1,8,32,64,104,128,192,256,512,1024,2048,4096 --reps 3 > tool-qwen3-bf16.txt 2>&1
date
$M bench ragged_dot --preset qwen3-30b-a3b --dtype f32 --passes fwd,dlhs --tokens 1,8,32,64,128,256,512,1024,2048,4096 --reps 3 > tool-qwen3-f32.txt 2>&1
date
$M bench ragged_dot --preset deepseek-v3 --dtype bf16 --passes fwd,dlhs --tokens 1,8,32,64,128,256,512,1024 --reps 3 > tool-dsv3-bf16.txt 2>&1
date
$M bench layer --preset all --tokens 1,8,32,64 --reps 3 > layer-all.txt 2>&1
date
date
