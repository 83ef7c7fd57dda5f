#!/bin/bash
# Before / after one_chunk_slabs: the tool built with the old src/cpu/ragged_dot_stream.cpp
# (d73d901's, compiled into a copy of libmoekit.a) against build/moekit, in turn, kAuto.
# Usage: ab-slabs.sh OLD_TOOL rounds > ab-slabs.txt
old=$1; rounds=${2:-3}
for r in $(seq "$rounds"); do
  for p in deepseek-v2-lite gpt-oss-20b mixtral-8x7b qwen3-30b-a3b olmoe-1b-7b; do
    for t in before after; do
      tool=$old; [ $t = after ] && tool=./build/moekit
      echo "round $r $p $t: $($tool bench ragged_dot --preset $p --dtype bf16 --tokens 1,2,4,8 \
        --passes fwd --reps 11 2>/dev/null | grep -E '^ +[0-9]+ +fwd +all' \
        | awk '{printf "T=%s %s ms %s | ", $1, $5, $NF}')"
    done
  done
done
