#!/bin/bash
# kCpuStream forced against oneDNN in the same loop, the input gradient (bf16, the dot-product
# form, items of more than 32 rows through the transposed pairs), around and past kAuto's bound.
# Usage: sweep-dlhs-stream.sh > dlhs-stream.txt
run() { ./build/moekit bench ragged_dot --dtype bf16 --passes dlhs --reps 5 --impl stream --baseline onednn "$@" 2>/dev/null | grep -E "^ +[0-9]+ +dlhs|preset="; }
run --preset qwen3-30b-a3b --tokens 1024,2048,4096,8192
run --preset deepseek-v3 --tokens 1024,2048,4096 --mem-limit-gib 18
run --preset olmoe-1b-7b --tokens 1024,2048,4096
run --preset gpt-oss-20b --tokens 1024,2048,4096
run --preset mixtral-8x7b --tokens 256,512,1024
