#!/bin/bash
# Issue 35's figures on an AVX2 host (AMD EPYC family 25 model 1, Zen 3: no AVX-512, no
# AVX512-BF16); every earlier record was taken on Zen 4 (AVX512-BF16) or a Xeon with AMX. The
# commands of ../ragged_dot_packed_f32-cpu-2026-11-29/sweep.sh (ragged_dot on packed weights
# beside kAuto on the same weights unpacked, in one loop), on qwen3-30b-a3b only (deepseek-v3's
# sweep did not fit the session: stopped before its first result, its probe lines in
# sweep-f32-fwd.txt), and
# the layer forward on packed weights at 1-64 tokens (../layer_packed-cpu-2026-11-29/run.sh's
# command) on qwen3-30b-a3b.
D=$(dirname "$0")
M=${M:-/work/main/build/moekit}
S=$D/../ragged_dot_packed_f32-cpu-2026-11-29/sweep.sh
lscpu > "$D/lscpu.txt"
for run in "f32 fwd" "bf16 fwd" "f32 dlhs" "bf16 dlhs"; do
  set -- $run
  echo "$run from $(date -u +%H:%M:%S)" >&2
  # sweep.sh loops over both presets; qwen3-30b-a3b is its first: the file keeps that part.
  [ "$1 $2" = "f32 fwd" ] && continue  # taken first: sweep-f32-fwd.txt
  M=$M DT=$1 PASS=$2 timeout 600 "$S" > "$D/sweep-$1-$2.txt" 2>&1 &
  pid=$!
  while sleep 5; do
    grep -q '^## deepseek-v3' "$D/sweep-$1-$2.txt" && { pkill -P $pid; kill $pid; break; }
    kill -0 $pid 2>/dev/null || break
  done
  wait $pid 2>/dev/null
done
echo "layer from $(date -u +%H:%M:%S)" >&2
$M bench layer --preset qwen3-30b-a3b --tokens 1,8,32,64 --reps 3 --cache-mib 128 \
  --packed-weights > "$D/layer-qwen3-bf16.txt" 2>&1
echo "done at $(date -u +%H:%M:%S)" >&2
