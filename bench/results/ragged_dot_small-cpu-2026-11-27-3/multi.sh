#!/bin/bash
# multi.sh "bin1 bin2 ..." < shapes: each shape, each build in turn, ROUNDS times; ms only
bins=$1
while read -r args; do
  [ -z "$args" ] && continue
  line="$args |"
  for round in $(seq ${ROUNDS:-2}); do
    for b in $bins; do
      r=$(EVEN=1 REPS=${REPS:-5} /tmp/ov/$b $args 0 | sed 's/.*| v0 \([0-9.]*\) ms.*/\1/')
      line="$line $b $r"
    done
    line="$line ;"
  done
  echo "$line"
done
