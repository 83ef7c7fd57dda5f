#!/bin/bash
# A/B: the packed forward with its chunks after a group's first prefetching the group's next panel
# into L2 (MOEKIT_PACKED_AHEAD set; an A/B switch of the build under test only) against without,
# processes alternating off / on twice; each line's share of the floor is against the dense rate
# its own process measured (these token counts are compute-bound, 2-4 chunks of rows a group).
M=${M:-/work/main/build/moekit}
run() {  # preset dtype tokens [extra]
  $M bench ragged_dot --preset $1 --dtype $2 --passes fwd --tokens $3 --reps 7 --cache-mib 128 \
    --rhs-packed ${@:4} 2>&1 | grep -E "^ +[0-9]+ +fwd" | awk '{print $5, $13}'
}
for cfg in "qwen3-30b-a3b f32 256,512" "qwen3-30b-a3b bf16 256,512" "deepseek-v3 f32 512 --mem-limit-gib 8" \
           "deepseek-v3 bf16 512 --mem-limit-gib 8" "mixtral-8x7b bf16 64 --matmul up --mem-limit-gib 8"; do
  for round in 1 2; do
    echo "## $cfg off (round $round): ms of-floor"; run $cfg
    echo "## $cfg on  (round $round): ms of-floor"; MOEKIT_PACKED_AHEAD=1 run $cfg
  done
done
