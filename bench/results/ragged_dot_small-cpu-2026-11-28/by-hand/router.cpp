// The layer's router matmul alone ([T, 2048] x [1, 2048, 128] bf16 into f32, kAuto), 25 calls,
// each after one of five states in turn: 0 nothing (warm), 1 a single-thread write of 256 MiB, 2 a
// parallel write of it, 3 the main thread spinning 20 ms alone, 4 a 4096-row oneDNN matmul.
//   g++ -O2 -std=c++20 -fopenmp -Iinclude router.cpp build/libmoekit.a -o router -ldnnl -lhwy \
//     -lfmt -L/usr/local/cuda/lib64 -lcudart -lcublas && ./router 1
// (from the repository root, after `make build`). Its figures: ../router-first-call.txt.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "moekit/ragged_dot.h"
using namespace moekit;
int main(int argc, char** argv) {
  const int64_t T = argc > 1 ? atoi(argv[1]) : 1, H = 2048, E = 128;
  std::vector<uint16_t> x(T * H, 0x3f80), w(H * E, 0x3c00);
  std::vector<float> out(T * E);
  std::vector<char> junk(256 << 20, 1);
  const int32_t rows[1] = {int32_t(T)};
  for (int rep = 0; rep < 25; ++rep) {
    bool flush = rep % 2;
    int mode = rep % 5;
    flush = mode;
    (void)flush;
    if (mode == 1) {
      for (size_t i = 0; i < junk.size(); i += 64) junk[i]++;
    }
    if (mode == 2) {
#pragma omp parallel for
      for (size_t i = 0; i < junk.size(); i += 64) junk[i]++;
    }
    if (mode == 4) {
      static std::vector<uint16_t> A(4096 * 2048, 0x3f80), B(2048 * 1536, 0x3c00), C(4096 * 1536);
      const int32_t r4[1] = {4096};
      RaggedDotOptions oo;
      oo.impl = RaggedDotImpl::kOneDnn;
      (void)ragged_dot(ConstTensorView(A.data(), DType::kBF16, {4096, 2048}),
                       ConstTensorView(B.data(), DType::kBF16, {1, 2048, 1536}), r4,
                       TensorView(C.data(), DType::kBF16, {4096, 1536}), oo);
    }
    if (mode == 3) {
      auto e = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
      while (std::chrono::steady_clock::now() < e) {
      }
    }
    RaggedDotImpl ran;
    RaggedDotOptions o;
    o.ran = &ran;
    auto t0 = std::chrono::steady_clock::now();
    Status s = ragged_dot(ConstTensorView(x.data(), DType::kBF16, {T, H}),
                          ConstTensorView(w.data(), DType::kBF16, {1, H, E}), rows,
                          TensorView(out.data(), DType::kF32, {T, E}), o);
    double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    printf("%s mode=%d %.3f ms ran=%s\n", s.ok() ? "ok" : "ERR", mode, ms, impl_name(ran));
  }
}
