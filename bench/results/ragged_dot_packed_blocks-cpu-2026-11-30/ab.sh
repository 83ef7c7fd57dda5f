#!/bin/bash
# A/B of the packed kernel's contraction blocks, taken with a build of the blocked kernel whose
# block_steps() read MOEKIT_PACKED_BLOCK_STEPS (a line dropped before it landed; 1000000000 =
# unblocked): DT, T (token counts), PRESET, BS (block steps), PASS; two rounds in turn.
M=/work/main/build/moekit
DT=${DT:-f32}; T=${T:-128,512}; PRESET=${PRESET:-deepseek-v3}
limit=$([ $PRESET = deepseek-v3 ] && echo "--mem-limit-gib 8")
for round in 1 2; do
  for bs in ${BS:-1000000000 1024 512 256}; do
    echo "## round $round block $bs $PRESET $DT $(date -u +%H:%M:%S)"
    MOEKIT_PACKED_BLOCK_STEPS=$bs $M bench ragged_dot --preset $PRESET --dtype $DT --passes ${PASS:-fwd} --tokens $T --reps 5 \
      --cache-mib 128 --rhs-packed --baseline auto $limit 2>&1 | grep -E "^ +[0-9]+ +${PASS:-fwd}"
  done
done
