#!/bin/bash
# A/B in turn: the binary before (OLD, 423e2f2) and after (NEW) the 3-row f32 chunks, the forward
# on packed weights, f32 (DT), ROUNDS rounds; prints each line's ms, dense ms, floor ms, share.
OLD=${OLD:-/tmp/old/build/moekit} NEW=${NEW:-/work/main/build/moekit}
DT=${DT:-f32} PASS=${PASS:-fwd} ROUNDS=${ROUNDS:-2}
for r in $(seq $ROUNDS); do
  for preset in ${PRESETS:-qwen3-30b-a3b deepseek-v3}; do
    T=$([ $preset = deepseek-v3 ] && echo ${TD:-128,256,512,1024} || echo ${TQ:-64,128,256,512,1024})
    limit=$([ $preset = deepseek-v3 ] && echo "--mem-limit-gib 8")
    for b in OLD NEW; do
      bin=${!b}
      $bin bench ragged_dot --preset $preset --dtype $DT --passes $PASS --tokens $T --reps 5 \
        --cache-mib 128 --rhs-packed $limit 2>&1 | grep -E "^ +[0-9]+ +$PASS" |
        awk -v r=$r -v b=$b -v p=$preset '{printf "round %d %-14s %s tokens %5s  %9s ms  dense %8s ms  floor %8s ms  %s\n", r, p, b, $1, $5, $7, $11, $13}'
    done
  done
done
