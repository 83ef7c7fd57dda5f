#!/bin/bash
# The committed rule (dot_chunk_fits_l1 -> chunks of 6 against 4) against the same build with it
# switched off, call by call in one loop: MOEKIT_AB=0 the rule, MOEKIT_AB_BASE=1 without it;
# speedup = without / with. A scratch switch in DotItem (never committed).
M=/work/main/build/moekit
run() { MOEKIT_AB=0 MOEKIT_AB_BASE=1 $M bench ragged_dot "$@" --passes dlhs --reps 5 --cache-mib 128 --impl stream --baseline stream 2>&1 | grep -E "^ +[0-9]+ +dlhs"; }
date
for imb in 0 0.25; do
  echo "== imbalance $imb"
  echo "-- mixtral-8x7b bf16"; run --preset mixtral-8x7b --dtype bf16 --tokens 4,8,16,24,32,48 --imbalance $imb
  echo "-- gpt-oss-20b bf16"; run --preset gpt-oss-20b --dtype bf16 --tokens 16,32,40,48,64,96 --imbalance $imb
  echo "-- deepseek-v3 bf16"; run --preset deepseek-v3 --dtype bf16 --tokens 128,224,256,448,512 --imbalance $imb --mem-limit-gib 6
  echo "-- deepseek-v3 f32"; run --preset deepseek-v3 --dtype f32 --tokens 64,96,128,160 --imbalance $imb --mem-limit-gib 6
  echo "-- mixtral-8x7b f32"; run --preset mixtral-8x7b --dtype f32 --tokens 4,8,16,32 --imbalance $imb
done
date
