#!/bin/bash
# usage: ab.sh preset tokens rounds "ENV..." ...   prints A ms, B ms, B/A per variant
preset=$1; tokens=$2; rounds=$3; shift 3
for r in $(seq $rounds); do
  for v in "$@"; do
    out=$(env MK_AB=1 $v ./build/moekit bench ragged_dot --preset $preset --dtype bf16 --tokens $tokens --passes ${PASSES:-fwd} --reps ${REPS:-11} --impl stream --baseline stream ${EXTRA:-} 2>/dev/null | grep -E "^ +[0-9]+ +(fwd|dlhs) +all" | awk '{printf "%s:%s A %s B %s B/A %.3f | ", $1,$2,$5,$(NF-1),$(NF-1)/$5}')
    echo "r$r [$v] $out"
  done
done
