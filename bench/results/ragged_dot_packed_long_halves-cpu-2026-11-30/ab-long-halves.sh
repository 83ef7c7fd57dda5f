#!/bin/bash
# deepseek-v3 forward (its panels in blocks of the contraction): groups of 3+ rows on the halves
# (MOEKIT_LONG_HALVES_FROM=3, a build not landed) against as landed (the halves from 17 rows in
# f32, 8 in bf16), in turn, the same binary.
BIN=${BIN:-/tmp/new/build/moekit}
for round in ${ROUNDS:-1 2}; do
  for from in landed 3; do
    echo "## round $round from=$from $(date -u +%H:%M:%S)"
    for dt in f32 bf16; do
      if [ $from = landed ]; then env -u MOEKIT_LONG_HALVES_FROM $BIN bench ragged_dot --preset deepseek-v3 --dtype $dt --passes fwd --tokens 128,256,512 \
        --reps 5 --cache-mib 128 --rhs-packed --baseline auto 2>&1 | grep -E "^ +[0-9]+ +fwd" | sed "s/^/$dt /"
      else MOEKIT_LONG_HALVES_FROM=$from $BIN bench ragged_dot --preset deepseek-v3 --dtype $dt --passes fwd --tokens 128,256,512 \
        --reps 5 --cache-mib 128 --rhs-packed --baseline auto 2>&1 | grep -E "^ +[0-9]+ +fwd" | sed "s/^/$dt /"; fi
    done
  done
done
