#!/bin/bash
# The layer's forward on packed expert weights beside the default forward, in one loop, every
# preset at 1 / 8 / 32 / 64 tokens (deepseek-v3 on a subset of its experts, as the bench says),
# bf16; then in f32 the two presets.
M=${M:-/work/main/build/moekit}
$M bench layer --preset all --tokens 1,8,32,64 --reps 3 --cache-mib 128 --packed-weights > bf16.txt 2>&1
for p in qwen3-30b-a3b deepseek-v3; do
  $M bench layer --preset $p --dtype f32 --tokens 1,8,32,64 --reps 3 --cache-mib 128 --packed-weights
done > f32.txt 2>&1
