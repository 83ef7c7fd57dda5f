#!/bin/bash
# The packed prototype (packed.cpp) at 4 / 8 / 12 / 16 rows a group (16: two chunks of 8), software
# prefetch off (DIST=0) and 32 lines ahead (DIST=32), then the library's forward on the same shape
# and rows (--imbalance 0: every group the same rows), one after the other.
#   g++ -O2 -std=c++20 -fopenmp -mavx512f -mavx512bw packed.cpp -o packed
M=/work/main/build/moekit
export OMP_NUM_THREADS=2
run() {  # E K n preset tokens...
  local E=$1 K=$2 n=$3 preset=$4; shift 4
  for rows in 4 8 12 16; do
    chunks=1; R=$rows; [ $rows = 16 ] && R=8 chunks=2
    for d in 0 32; do echo -n "DIST=$d "; DIST=$d ./packed $E $K $n $R 2 5 $chunks; done
  done
  $M bench ragged_dot --preset $preset --matmul up --dtype bf16 --passes fwd --tokens $(IFS=,; echo "$*") \
    --reps 5 --cache-mib 128 --imbalance 0 --impl stream 2>&1 | grep -E "^ +[0-9]+ +(fwd|[0-9.]+ )"
}
echo "## mixtral-8x7b gate|up"; run 8 4096 28672 mixtral-8x7b 16 32 48 64
echo "## gpt-oss-20b gate|up"; run 32 2880 5760 gpt-oss-20b 32 64 96 128
echo "## qwen3-30b-a3b gate|up"; run 128 2048 1536 qwen3-30b-a3b 64 128 192 256
