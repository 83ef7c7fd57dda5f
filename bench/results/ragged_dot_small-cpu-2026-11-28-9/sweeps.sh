#!/bin/bash
# The session's end-of-session sweep (after 2fef237), run from this folder, the machine quiet (no
# build or bench of ours beside it).
set -x
M=/work/main/build/moekit
date
$M bench ragged_dot --preset qwen3-30b-a3b --dtype bf16 --passes fwd,dlhs --tokens 1,8,32,64,128,256,512,1024,2048,4096 --reps 3 --cache-mib 128 > tool-qwen3-bf16.txt 2>&1
$M bench ragged_dot --preset deepseek-v3 --dtype bf16 --passes fwd,dlhs --tokens 1,8,32,64,128,256,512,1024,2048,4096 --reps 3 --cache-mib 128 --mem-limit-gib 20 > tool-dsv3-bf16.txt 2>&1
$M bench layer --preset all --tokens 1,8,32,64 --reps 3 --cache-mib 128 > layer-all.txt 2>&1
date
