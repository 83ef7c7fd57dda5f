#!/bin/bash
# In one loop: the timed arm runs the change (MOEKIT_AB=0), the baseline arm the blocks and
# next-item prefetch as before it (MOEKIT_AB_BASE=1, a scratch switch in PlanAxpy / AxpyItem).
# Columns: tokens, pass, rows, new ms, old ms, speedup (old / new).
M=/work/main/build/moekit
f() { grep -E '^ +[0-9]+ +(fwd|dlhs) ' | awk '{print $1, $2, $4, $5, $(NF-2), $(NF-1)}'; }
ab() { MOEKIT_AB=0 MOEKIT_AB_BASE=1 $M bench ragged_dot "$@" --cache-mib 128 --impl stream --baseline stream 2>&1 | f; }
echo "== qwen3 bf16 fwd, rows spread evenly ($(date +%T))"; ab --preset qwen3-30b-a3b --dtype bf16 --passes fwd --imbalance 0 --tokens 32,48,64,80,96,128,176 --reps 9
echo "== qwen3 bf16 fwd, routed ($(date +%T))"; ab --preset qwen3-30b-a3b --dtype bf16 --passes fwd --tokens 1,8,32,64,128,256 --reps 9
echo "== deepseek-v3 bf16 fwd ($(date +%T))"; ab --preset deepseek-v3 --dtype bf16 --passes fwd --tokens 64,96,128,176,352 --reps 5 --mem-limit-gib 20
for p in qwen3-30b-a3b gpt-oss-20b deepseek-v2-lite olmoe-1b-7b; do for mm in up down; do
  echo "== $p $mm ($(date +%T))"; ab --preset $p --matmul $mm --dtype bf16 --passes fwd --tokens 32,64 --reps 7
done; done
for mm in up down; do echo "== mixtral-8x7b $mm ($(date +%T))"; ab --preset mixtral-8x7b --matmul $mm --dtype bf16 --passes fwd --tokens 16,32,48 --reps 5; done
echo "== qwen3 f32 fwd, control: f32 unchanged ($(date +%T))"; ab --preset qwen3-30b-a3b --dtype f32 --passes fwd --tokens 64,128 --reps 7
echo "== done ($(date +%T))"
