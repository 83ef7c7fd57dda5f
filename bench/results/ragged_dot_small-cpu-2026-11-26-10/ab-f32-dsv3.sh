#!/bin/sh
# ab-f32.sh for deepseek-v3, whose f32 weights (14 GiB) pass the bench's default 12 GiB limit
# (there the bench stopped at its first token count: "a buffer of 11.98 GiB ... would pass").
for round in 1 2 3; do
  for tool in new f32; do
    echo "== round $round $tool deepseek-v3"
    /tmp/ov/moekit-$tool bench ragged_dot --preset deepseek-v3 --dtype f32 --passes dlhs \
      --tokens 8,32,64,128 --reps 3 --mem-limit-gib 20 2>&1 |
      grep -E "T=[0-9]+ +[0-9.]+ ms|^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9]+$|note"
  done
done
