#!/bin/bash
# The layer's backward before (main at 0353146) and after the dot shapes' L1 rule, two tools in
# turn, twice: mixtral-8x7b and gpt-oss-20b at 8 and 32 tokens.
for round in 1 2; do
  for b in A N; do
    echo "== $b round $round $(date +%T)"
    for p in mixtral-8x7b gpt-oss-20b; do
      /tmp/moekit$b bench layer --preset $p --tokens 8,32 --reps 3 --cache-mib 128 2>&1 | grep -E "^$p|^gmm_|^layer "
    done
  done
done
