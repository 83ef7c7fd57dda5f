#!/bin/bash
# The layer's forward at 1 token against its floor, before / after the parts of the contraction:
# OLD_TOOL is d8fc5ea's src/cpu/ragged_dot_stream.cpp compiled into a copy of libmoekit.a and
# linked into the same tool; the shared expert's step beside the layer.
# Usage: ab-parts-layer.sh OLD_TOOL rounds > ab-parts-layer.txt
old=$1; rounds=${2:-3}
for r in $(seq "$rounds"); do
  for p in deepseek-v2-lite; do
    for t in before after; do
      tool=$old; [ $t = after ] && tool=./build/moekit
      out=$($tool bench layer --preset $p --tokens 1,8 --reps 11 2>/dev/null)
      echo "round $r $p $t: $(echo "$out" | grep -E '^shared|^forward floor' | sed 's/.*the forward at \(.*\) of it/forward at \1 of the floor/; s/^shared *\([0-9.]*\).*/shared \1 ms,/' | tr '\n' ' ')"
    done
  done
done
