#!/bin/bash
# kCpuStream forced against oneDNN in the same loop, the forward (bf16), around and past kAuto's
# bounds. Usage: sweep-stream.sh > fwd-stream.txt
set -e
run() { ./build/moekit bench ragged_dot --dtype bf16 --passes fwd --reps 5 --impl stream --baseline onednn "$@" 2>/dev/null | grep -E "^ +[0-9]+ +fwd|preset="; }
run --preset qwen3-30b-a3b --tokens 2048,4096,8192
run --preset deepseek-v3 --tokens 2048,4096 --mem-limit-gib 18
run --preset deepseek-v2-lite --tokens 1024,2048,4096
run --preset olmoe-1b-7b --tokens 1024,2048,4096
run --preset gpt-oss-20b --tokens 1024,2048,4096
run --preset mixtral-8x7b --tokens 128,256,512,1024
