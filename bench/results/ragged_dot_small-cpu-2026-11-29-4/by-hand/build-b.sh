#!/bin/bash
# Side B of a two-builds-in-one-binary A/B: ragged_dot_stream.cpp compiled again with extra flags
# ($@), its entry renamed row_grouped_gemm_stream_ab, every other symbol it defines made local
# (objcopy; its COMDAT groups dropped, else the linker discards its template instances), linked
# into the moekit tool beside side A; MOEKIT_AB=1 runs B, 0 runs A, call by call with
# MOEKIT_AB_BASE. Side A: the build dir's own build of main with ab-two-builds.diff applied
# (`cmake --build build --target moekit_tool` first). Never committed to the library.
#   build-b.sh [FLAGS...]   ->  /tmp/ira/moekit-ab
set -e
mkdir -p /tmp/ira
cd /work/main/build
/usr/bin/c++ -DFMT_SHARED -DHWY_SHARED_DEFINE -DMOEKIT_CUDA_SM80=1 -DMOEKIT_CUDA_SM90=1 -DMOEKIT_HAS_CUDA=1 -I/work/main/include -I/work/main/src -isystem /usr/local/cuda/include -O3 -DNDEBUG -fPIC -Wall -Wextra -Werror=return-type -fopenmp -std=c++20 -falign-functions=64 "$@" -DMOEKIT_AB_SIDE_B -Drow_grouped_gemm_stream=row_grouped_gemm_stream_ab -o /tmp/ira/b.o -c /work/main/src/cpu/ragged_dot_stream.cpp
nm --defined-only -g /tmp/ira/b.o | awk '{print $3}' | grep -v row_grouped_gemm_stream_ab > /tmp/ira/local.txt
objcopy --localize-symbols=/tmp/ira/local.txt --remove-section=.group /tmp/ira/b.o /tmp/ira/b2.o
cmd=$(ninja -t commands moekit_tool | tail -1 | sed 's/^: && //; s/ && :$//')
cmd=${cmd/ -o moekit / -o \/tmp\/ira\/moekit-ab \/tmp\/ira\/b2.o }
eval "$cmd"
