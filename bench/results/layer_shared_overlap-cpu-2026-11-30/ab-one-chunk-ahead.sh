#!/bin/bash
# A/B: the packed forward's groups of one chunk (at most 8 rows) prefetching their next panel into
# L2 as they go (two lines a contraction step; MOEKIT_AHEAD1 = the fewest rows that do, an A/B
# switch of the build under test only, never committed) against not (main at 61d20b7), processes
# alternating off / on twice. Printed: tokens, ms, share of the floor, per token count.
M=/work/main/build/moekit
run() {
  $M bench ragged_dot --preset $1 --dtype $2 --passes fwd --tokens $3 --reps 7 --cache-mib 128 \
    --rhs-packed ${@:4} 2>&1 | grep -E "^ +[0-9]+ +fwd" | awk '{printf "%s %s %s | ", $1, $5, $13} END {print ""}'
}
for cfg in "deepseek-v2-lite bf16 32,64,85 --matmul up" "qwen3-30b-a3b bf16 64,96,128" "deepseek-v3 bf16 64,128,192 --mem-limit-gib 8" "qwen3-30b-a3b f32 64,96,128" "mixtral-8x7b bf16 8,16,32 --matmul up --mem-limit-gib 8"; do
  for round in 1 2; do
    echo "$cfg off r$round: $(run $cfg)"
    echo "$cfg on3 r$round: $(MOEKIT_AHEAD1=3 run $cfg)"
  done
done
