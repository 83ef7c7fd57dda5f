#!/bin/bash
# The input gradient's share of the floor after 12b0e83 at the token counts it changes
# (deepseek-v3, all 256 experts), main's tool.
M=/work/main/build/moekit
date
$M bench ragged_dot --preset deepseek-v3 --dtype f32 --passes dlhs --tokens 64,128,256 --reps 3 --cache-mib 128 --mem-limit-gib 20 2>&1 | grep -E "^ +[0-9]+ +dlhs|^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9]+$"
$M bench ragged_dot --preset deepseek-v3 --dtype bf16 --passes dlhs --tokens 256,512 --reps 3 --cache-mib 128 --mem-limit-gib 20 2>&1 | grep -E "^ +[0-9]+ +dlhs|^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9]+$"
date
