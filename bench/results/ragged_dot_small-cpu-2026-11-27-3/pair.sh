#!/bin/bash
# pair.sh OLD NEW NEWVARIANT: each shape, old then new build, twice
old=$1; new=$2; nv=$3
while read -r args; do
  for round in $(seq ${ROUNDS:-2}); do
    o=$(EVEN=1 REPS=${REPS:-5} /tmp/ov/$old $args 0 | sed 's/.*| //')
    n=$(EVEN=1 REPS=${REPS:-5} /tmp/ov/$new $args $nv | sed 's/.*| //')
    echo "$args | old $o | new $n"
  done
done <<SHAPES
fwd 2048 2048 64 8 64 0.187
fwd 1024 2048 64 8 64 0.187
fwd 2048 1536 64 8 128 0.187
fwd 2048 768 128 8 128 0.187
fwd 2048 768 104 8 128 0.187
fwd 2048 768 256 8 128 0.187
dlhs 2048 768 128 8 128 0.187
dlhs 2048 768 256 8 128 0.187
dlhs 2048 768 512 8 128 0.187
SHAPES
