#!/bin/bash
# The f32 forward on packed weights (--rhs-packed) against the same weights unpacked, kAuto
# (--baseline auto), in one loop per token count: the two shapes (--matmul ffn: K = H,
# n = F), qwen3-30b-a3b with all 128 experts, deepseek-v3 on as many of its 256 experts as
# --mem-limit-gib 8 holds beside the packed copy (rows per expert as the whole preset's).
M=${M:-/work/main/build/moekit}
T=1,8,32,64,128,256,512,1024,2048,4096
echo "## qwen3-30b-a3b ffn f32"
$M bench ragged_dot --preset qwen3-30b-a3b --dtype f32 --passes fwd --tokens $T \
  --reps 5 --cache-mib 128 --rhs-packed --baseline auto 2>&1 | grep -E "^ +[0-9]+ +fwd|note|read"
echo "## deepseek-v3 ffn f32 (--mem-limit-gib 8)"
$M bench ragged_dot --preset deepseek-v3 --dtype f32 --passes fwd --tokens $T \
  --reps 5 --cache-mib 128 --rhs-packed --baseline auto --mem-limit-gib 8 2>&1 | grep -E "^ +[0-9]+ +fwd|note|read"
