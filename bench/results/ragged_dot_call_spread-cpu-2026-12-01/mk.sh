#!/bin/bash
# Builds the in-process harness against /work/main/build's library.
B=/work/main/build
g++ -O2 -mavx2 -mfma -std=c++20 -I/work/main/include two-shapes.cpp -o two-shapes -Wl,-rpath,/usr/local/cuda/lib $B/libmoekit.a /usr/local/cuda/lib/libcudart.so /usr/local/cuda/lib/libcublas.so /usr/local/cuda/lib/libcublasLt.so -ldnnl -lhwy -lfmt -fopenmp -ldl -lrt -lpthread -L/usr/local/cuda/targets/x86_64-linux/lib -lcudadevrt -lcudart_static
