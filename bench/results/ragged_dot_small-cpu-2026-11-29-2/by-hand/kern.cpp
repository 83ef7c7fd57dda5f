// axpy_pairs_panels alone, one thread, weights of kc rows x cols (in L1/L2), R rows (the one-chunk
// kernel over every panel; ../../ragged_dot_small-cpu-2026-11-26-7/by-hand/axpy_pairs_kernel.cpp
// timed axpy_pairs on one panel the same way).
//   kern R kc cols
//   g++ -O2 -std=c++20 -fopenmp kern.cpp build/libmoekit.a -ldnnl -lhwy -lfmt -o kern
//   (kernel-blocks.txt: for R in 3 4 5 6 8 11; for kc in 8 16 42 84: kern R kc 1536; twice)
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
namespace moekit::detail::stream {
struct Lines {
  const char* base = nullptr;
  int64_t stride = 0, row_lines = 0, first = 0, last = 0;
  bool into_l1 = false;
};
void axpy_pairs_panels(int rows, const uint16_t* a, int64_t lda, int64_t kc, const uint16_t* b,
                       int64_t ldb, int64_t cols, float* acc, int64_t ld_acc, const Lines& ahead);
}  // namespace moekit::detail::stream
using namespace moekit::detail::stream;
static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
int main(int argc, char** argv) {
  const int R = atoi(argv[1]);
  const int64_t kc = atoi(argv[2]), cols = atoi(argv[3]);
  const int64_t lda = 2048;
  std::vector<uint16_t> a(R * lda, 0x3f80), b(kc * cols, 0x3c00);
  std::vector<float> acc(R * cols, 0.f);
  const long iters = 4000000000L / (R * kc * cols) + 1;
  double best = 1e9;
  for (int rep = 0; rep < 9; ++rep) {
    double t = now();
    for (long i = 0; i < iters; ++i)
      axpy_pairs_panels(R, a.data(), lda, kc, b.data(), cols, cols, acc.data(), cols, Lines{});
    t = now() - t;
    if (t < best) best = t;
  }
  std::printf("R %d kc %ld cols %ld: %.1f GFLOP/s\n", R, (long)kc, (long)cols,
              2.0 * R * kc * cols * iters / best / 1e9);
}
