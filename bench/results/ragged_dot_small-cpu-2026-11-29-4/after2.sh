#!/bin/bash
# The input gradient's share of the floor after 12b0e83 on the two presets the rule changes most
# (main at 35372c1), bf16, one run each.
M=/work/main/build/moekit
date
for p in gpt-oss-20b mixtral-8x7b; do
  $M bench ragged_dot --preset $p --dtype bf16 --passes dlhs --tokens 1,8,16,32,64,128,256,512 --reps 3 --cache-mib 128 2>&1 | sed -n '/^tokens  pass/,$p'
done
date
