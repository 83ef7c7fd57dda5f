// By hand: kCpuStream's pair kernels alone, one thread, their operands in cache, linked against
// libmoekit.a (the declarations below copy src/cpu/ragged_dot_stream.cpp's of 2026-11-26).
//   kernels panels R kb n K   axpy_pairs_panels: R rows, blocks of kb weight rows of [K, n]
//   kernels dot R kc cols     dot_pairs: R rows against `cols` weight rows of kc, 4 at a time
// Prints GFLOP/s (best of the repetitions).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace moekit::detail::stream {
struct Lines {
  const char* base = nullptr;
  int64_t stride = 0, row_lines = 0, rows = 0;
};
void axpy_pairs_panels(int rows, const uint16_t* a, int64_t lda, int64_t kc, const uint16_t* b,
                       int64_t ldb, int64_t cols, float* acc, int64_t ld_acc, const Lines& ahead);
void dot_pairs(int rows, const uint16_t* a, int64_t lda, int64_t kc, const uint16_t* b, int64_t ldb,
               float* out, int64_t ld_out, const Lines& ahead);
}  // namespace moekit::detail::stream
using namespace moekit::detail::stream;

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s panels R kb n K | dot R kc cols\n", argv[0]);
    return 2;
  }
  const bool dot = std::strcmp(argv[1], "dot") == 0;
  const int R = atoi(argv[2]);
  double best = 1e9, flops = 0;
  if (!dot && argc >= 6) {
    const int64_t kb = atoi(argv[3]), n = atoi(argv[4]), K = atoi(argv[5]);
    std::vector<uint16_t> a(R * K, 0x3f80), b(K * n, 0x3c00);
    std::vector<float> acc(R * n);
    for (int rep = 0; rep < 200; ++rep) {
      const double t = now();
      for (int64_t k0 = 0; k0 < K; k0 += kb) {
        axpy_pairs_panels(R, a.data() + k0, K, kb, b.data() + k0 * n, n, n, acc.data(), n, Lines{});
      }
      best = std::min(best, now() - t);
    }
    flops = 2.0 * R * K * n;
  } else {
    const int64_t kc = atoi(argv[3]), cols = atoi(argv[4]);
    std::vector<uint16_t> a(R * kc, 0x3f80), b(cols * kc, 0x3c00);
    std::vector<float> out(R * cols);
    for (int rep = 0; rep < 200; ++rep) {
      const double t = now();
      for (int64_t c = 0; c < cols; c += 4) {
        dot_pairs(R, a.data(), kc, kc, b.data() + c * kc, kc, out.data() + c, cols, Lines{});
      }
      best = std::min(best, now() - t);
    }
    flops = 2.0 * R * kc * cols;
  }
  std::printf("%s R %d: %.0f GFLOP/s\n", argv[1], R, flops / best / 1e9);
}
