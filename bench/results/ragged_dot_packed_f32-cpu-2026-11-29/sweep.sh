#!/bin/bash
# The forward on packed weights (--rhs-packed) against the same weights unpacked, kAuto
# (--baseline auto), in one loop per token count: the two shapes (--matmul ffn: K = H,
# n = F), qwen3-30b-a3b with all 128 experts, deepseek-v3 on as many of its 256 experts as
# --mem-limit-gib 8 holds beside the packed copy (rows per expert as the whole preset's).
# DT=f32 (default) or bf16 (sweep-bf16.sh); PASS=fwd (default) or dlhs (sweep-dlhs.sh: the
# input gradient on the weights' transposes packed); T the token counts; PRESETS the presets.
M=${M:-/work/main/build/moekit}
DT=${DT:-f32}
PASS=${PASS:-fwd}
T=${T:-1,8,32,64,128,256,512,1024,2048,4096}
for preset in ${PRESETS:-qwen3-30b-a3b deepseek-v3}; do
  limit=$([ $preset = deepseek-v3 ] && echo "--mem-limit-gib 8")
  echo "## $preset ffn $DT $PASS $limit"
  $M bench ragged_dot --preset $preset --dtype $DT --passes $PASS --tokens $T --reps 5 \
    --cache-mib 128 --rhs-packed --baseline auto $limit 2>&1 | grep -E "^ +[0-9]+ +$PASS|note|read"
done
