#!/bin/bash
# As sweep.sh, in bf16: the two shapes (--matmul ffn) on packed weights against kAuto on
# the same weights unpacked, in one loop per token count.
M=${M:-/work/main/build/moekit}
T=1,8,32,64,128,256,512,1024,2048,4096
echo "## qwen3-30b-a3b ffn bf16"
$M bench ragged_dot --preset qwen3-30b-a3b --dtype bf16 --passes fwd --tokens $T \
  --reps 5 --cache-mib 128 --rhs-packed --baseline auto 2>&1 | grep -E "^ +[0-9]+ +fwd|note|read"
echo "## deepseek-v3 ffn bf16 (--mem-limit-gib 8)"
$M bench ragged_dot --preset deepseek-v3 --dtype bf16 --passes fwd --tokens $T \
  --reps 5 --cache-mib 128 --rhs-packed --baseline auto --mem-limit-gib 8 2>&1 | grep -E "^ +[0-9]+ +fwd|note|read"
