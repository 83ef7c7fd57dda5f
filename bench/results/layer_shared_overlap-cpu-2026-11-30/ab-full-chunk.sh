#!/bin/bash
# A/B: groups of exactly one full chunk (8 rows: the pair kernel's and, on AVX-512, the f32
# kernel's most) prefetching their next panel into L2 as they go (MOEKIT_AHEAD_FULL set; an A/B
# switch of the build under test only, never committed) against not (main at 0f7b5ca), processes
# alternating off / on, three rounds, at the 8-row points of the shapes.
M=/work/main/build/moekit
run() {
  $M bench ragged_dot --preset $1 --dtype $2 --passes $3 --tokens $4 --reps 7 --cache-mib 128 \
    --rhs-packed ${@:5} 2>&1 | grep -E "^ +[0-9]+ +(fwd|dlhs)" | awk '{printf "%s %s %s %s | ", $1, $2, $5, $13} END {print ""}'
}
for cfg in "deepseek-v3 bf16 fwd 256 --mem-limit-gib 8" "deepseek-v3 f32 dlhs 256 --mem-limit-gib 8" \
           "qwen3-30b-a3b bf16 fwd 128" "qwen3-30b-a3b bf16 dlhs 128"; do
  for round in 1 2 3; do
    echo "$cfg off r$round: $(run $cfg)"
    echo "$cfg on  r$round: $(MOEKIT_AHEAD_FULL=1 run $cfg)"
  done
done
