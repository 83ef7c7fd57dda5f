#!/bin/bash
# The layer's forward at 1 token against its floor, before / after one_chunk_slabs (as ab-slabs.sh).
# Usage: ab-slabs-layer.sh OLD_TOOL rounds > ab-slabs-layer.txt
old=$1; rounds=${2:-3}
for r in $(seq "$rounds"); do
  for p in deepseek-v2-lite gpt-oss-20b mixtral-8x7b; do
    for t in before after; do
      tool=$old; [ $t = after ] && tool=./build/moekit
      echo "round $r $p $t: $($tool bench layer --preset $p --tokens 1 --reps 11 2>/dev/null \
        | grep -E '^forward floor' | sed 's/.*= \([0-9.]*\) ms, .*the forward at \(.*\) of it/floor \1 ms, forward at \2/')"
    done
  done
done
