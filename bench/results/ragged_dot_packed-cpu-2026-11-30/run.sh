#!/bin/bash
# Issue 35's ragged_dot figure on packed weights, once more at the session's end (the same
# commands as ../ragged_dot_packed_f32-cpu-2026-11-29/sweep.sh): forward and input gradient (on
# the transposes packed), f32 and bf16, qwen3-30b-a3b and deepseek-v3, 1-4096 tokens, each beside
# kAuto on the same weights unpacked in one loop.
S=$(dirname "$0")/../ragged_dot_packed_f32-cpu-2026-11-29/sweep.sh
for pass in fwd dlhs; do
  for dt in f32 bf16; do
    T=$([ $pass = fwd ] && echo 1,8,32,64,128,256,512,1024,2048,4096 || echo 1,8,32,64,128,256,512,1024,4096)
    DT=$dt PASS=$pass T=$T "$S"
  done
done
