#!/bin/bash
# A/B: f32 groups of exactly one full chunk (8 rows) prefetching their next panel (MOEKIT_AHEAD1=8) vs not.
M=/work/main/build/moekit
run() {
  $M bench ragged_dot --preset $1 --dtype $2 --passes $3 --tokens $4 --reps 7 --cache-mib 128 \
    --rhs-packed ${@:5} 2>&1 | grep -E "^ +[0-9]+ +(fwd|dlhs)" | awk '{printf "%s %s %s %s | ", $1, $2, $5, $13} END {print ""}'
}
for cfg in "qwen3-30b-a3b f32 fwd 128" "qwen3-30b-a3b f32 dlhs 128" "deepseek-v3 f32 fwd 256 --mem-limit-gib 8" "deepseek-v3 f32 dlhs 256 --mem-limit-gib 8"; do
  for round in 1 2 3 4; do
    echo "$cfg off r$round: $(run $cfg)"
    echo "$cfg on8 r$round: $(MOEKIT_AHEAD1=8 run $cfg)"
  done
done
