#!/bin/bash
# The layer's forward on packed expert weights beside the default forward, in one loop, every
# preset at 1 / 8 / 32 / 64 tokens (deepseek-v3 on a subset of its experts, as the bench says).
/work/main/build/moekit bench layer --preset all --tokens 1,8,32,64 --reps 3 --cache-mib 128 --packed-weights
