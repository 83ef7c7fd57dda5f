// axpy_pairs alone, one thread, operands in L1/L2: R rows, kc contraction rows, one 64-col panel.
//   mk R kc use(0 write,1 read) ldb
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
namespace moekit::detail::stream {
struct Lines {
  const char* base = nullptr;
  int64_t stride = 0, row_lines = 0, rows = 0;
};
enum class PanelUse { kWrite, kRead };
void axpy_pairs(int rows, const uint16_t* a, int64_t lda, int64_t kc, const uint16_t* b,
                int64_t ldb, int64_t cols, float* acc, int64_t ld_acc, const Lines& ahead,
                uint32_t* panel, PanelUse use);
}  // namespace moekit::detail::stream
using namespace moekit::detail::stream;
static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
int main(int argc, char** argv) {
  const int R = atoi(argv[1]);
  const int64_t kc = atoi(argv[2]);
  const int use = atoi(argv[3]);
  const int64_t ldb = argc > 4 ? atoi(argv[4]) : 64;
  const int64_t lda = argc > 5 ? atoi(argv[5]) : kc, ldacc = argc > 6 ? atoi(argv[6]) : 64;
  std::vector<uint16_t> a(R * lda, 0x3f80), b(kc * ldb, 0x3c00);
  std::vector<float> acc(R * ldacc, 0.f);
  uint32_t* panel = static_cast<uint32_t*>(aligned_alloc(64, kc / 2 * 64 * 4));
  for (int64_t i = 0; i < kc / 2 * 64; ++i) panel[i] = 0x3c003c00;
  const int iters = 200000000 / (R * kc * 64);
  double best = 1e9;
  for (int rep = 0; rep < 7; ++rep) {
    double t = now();
    for (int i = 0; i < iters; ++i)
      axpy_pairs(R, a.data(), lda, kc, b.data(), ldb, 64, acc.data(), ldacc, Lines{}, panel,
                 use ? PanelUse::kRead : PanelUse::kWrite);
    t = now() - t;
    if (t < best) best = t;
  }
  std::printf("R %d kc %ld %s: %.0f GFLOP/s\n", R, (long)kc, use ? "read" : "write",
              2.0 * R * kc * 64 * iters / best / 1e9);
}
