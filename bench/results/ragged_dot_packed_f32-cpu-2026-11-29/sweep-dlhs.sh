#!/bin/bash
# The input gradient on the weights' transposes packed (--rhs-packed --passes dlhs: frozen
# weights, a second packed copy) against kAuto on the same weights unpacked ([E, K, n]), in one
# loop per token count, the issue's shapes (--matmul ffn), f32 then bf16: sweep.sh with PASS=dlhs.
for dt in f32 bf16; do
  DT=$dt PASS=dlhs T=1,8,32,64,128,256,512,1024,4096 "$(dirname "$0")/sweep.sh"
done
