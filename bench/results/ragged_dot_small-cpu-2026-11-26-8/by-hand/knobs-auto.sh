#!/bin/bash
# usage: knobs.sh preset tokens rounds "ENV1" "ENV2" ...
preset=$1; tokens=$2; rounds=$3; shift 3
extra=${EXTRA:-}
for r in $(seq $rounds); do
  for v in "$@"; do
    out=$(env $v ./build/moekit bench ragged_dot --preset $preset --dtype bf16 --tokens $tokens --passes ${PASSES:-fwd} --reps 5 $extra 2>/dev/null | grep -E "^ +[0-9]+ +(fwd|dlhs)" | awk '{printf "%s:%s %s ms %s | ", $1,$2,$5,$(NF)}')
    echo "r$r [$v] $out"
  done
done
