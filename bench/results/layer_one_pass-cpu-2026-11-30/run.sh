#!/bin/bash
# Issue 35, deliverable 3 (the layer's forward in one pass per group): what the one pass would
# remove, measured. The layer's forward at 1-64 tokens on every preset, the default and the
# packed forward in one loop, each step's median time (--json): the activation step and the
# intermediate's round trip are what a one-pass forward would take away.
M=${M:-/work/main/build/moekit}
$M bench layer --preset all --tokens 1,8,32,64 --reps 3 --cache-mib 128 --packed-weights --json \
  > layer.json 2> layer.log
