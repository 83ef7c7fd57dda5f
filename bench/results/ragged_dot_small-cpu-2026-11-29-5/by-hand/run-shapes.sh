#!/bin/bash
# packed E K n R V reps chunks: mixtral-8x7b's gate|up (8 experts, K 4096, n 28672), gpt-oss-20b's
# (32 experts, K 2880, n 5760), deepseek-v3's (40 experts of 256, K 7168, n 4096), qwen3-30b-a3b's
# (128 experts, K 2048, n 1536); 4 / 8 / 12 / 16 rows a group
export OMP_NUM_THREADS=2
for shape in "8 4096 28672" "32 2880 5760" "40 7168 4096" "128 2048 1536"; do
  ./packed $shape 4 2 5 1
  ./packed $shape 8 2 5 1
  ./packed $shape 12 2 5 1
  ./packed $shape 8 2 5 2
done
