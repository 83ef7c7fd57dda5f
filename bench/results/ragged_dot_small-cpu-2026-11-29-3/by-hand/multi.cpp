// 16 rows on a block of kc weight rows x cols: (a) 3 chunks of 5/5/6 panel by panel (panel buffer),
// (b) 2 chunks of 8 chunk-major through axpy_pairs_panels.  multi R kc cols mode
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
enum class PanelUse { kWrite, kRead };
void axpy_pairs(int rows, const uint16_t* a, int64_t lda, int64_t kc, const uint16_t* b,
                int64_t ldb, int64_t cols, float* acc, int64_t ld_acc, const Lines& ahead,
                uint32_t* panel, PanelUse use);
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
  const int mode = atoi(argv[4]), most = argc > 5 ? atoi(argv[5]) : 6;
  const int64_t pad = argc > 6 ? atoi(argv[6]) : 0, ldc = cols + pad,
                ldw = cols + (argc > 7 ? atoi(argv[7]) : 0);
  const int64_t lda = 4096;
  std::vector<uint16_t> a(R * lda, 0x3f80), b(kc * ldw, 0x3c00);
  std::vector<float> acc(R * ldc, 0.f);
  alignas(64) static uint32_t panel[64 * 64 * 4];
  const long iters = 4000000000L / (R * kc * cols) + 1;
  double best = 1e9;
  const int count = (R + most - 1) / most;
  for (int rep = 0; rep < 7; ++rep) {
    double t = now();
    for (long i = 0; i < iters; ++i) {
      if (mode == 0) {
        for (int64_t c0 = 0; c0 < cols; c0 += 64)
          for (int ci = 0; ci < count; ++ci) {
            const int r0 = R * ci / count, r1 = R * (ci + 1) / count;
            axpy_pairs(r1 - r0, a.data() + r0 * lda, lda, kc, b.data() + c0, ldw, 64,
                       acc.data() + r0 * ldc + c0, ldc, Lines{}, panel,
                       ci > 0 ? PanelUse::kRead : PanelUse::kWrite);
          }
      } else {
        for (int ci = 0; ci < count; ++ci) {
          const int r0 = R * ci / count, r1 = R * (ci + 1) / count;
          axpy_pairs_panels(r1 - r0, a.data() + r0 * lda, lda, kc, b.data(), ldw, cols,
                            acc.data() + r0 * ldc, ldc, Lines{});
        }
      }
    }
    t = now() - t;
    if (t < best) best = t;
  }
  std::printf("R %d kc %ld cols %ld mode %d most %d: %.1f GFLOP/s\n", R, (long)kc, (long)cols, mode,
              most, 2.0 * R * kc * cols * iters / best / 1e9);
}
