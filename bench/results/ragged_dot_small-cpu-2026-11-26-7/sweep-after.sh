#!/bin/bash
# After both commits: kAuto, the shapes, each pass beside oneDNN, the floor's share.
# Usage: sweep-after.sh > sweep-after.txt
b=./build/moekit
echo '$ moekit bench ragged_dot --preset qwen3-30b-a3b --dtype bf16 --tokens 1,8,32,64,128,256,512,1024,2048,4096 --passes fwd,dlhs --reps 5 --baseline onednn'
$b bench ragged_dot --preset qwen3-30b-a3b --dtype bf16 --tokens 1,8,32,64,128,256,512,1024,2048,4096 --passes fwd,dlhs --reps 5 --baseline onednn 2>/dev/null
echo '$ moekit bench ragged_dot --preset deepseek-v3 --dtype bf16 --tokens 256,512,1024,2048,4096 --passes fwd,dlhs --reps 3 --baseline onednn --mem-limit-gib 18'
$b bench ragged_dot --preset deepseek-v3 --dtype bf16 --tokens 256,512,1024,2048,4096 --passes fwd,dlhs --reps 3 --baseline onednn --mem-limit-gib 18 2>/dev/null
