// A plain parallel read of 1 GiB (one 8-byte load per 64-byte line), 30 times in one process,
// each pass's rate in GB/s: how much the machine's read rate drifts from second to second.
//   g++ -O2 -fopenmp readloop.cpp -o readloop && ./readloop
// Output on the 2-core Xeon of this session (2026-11-28): readloop.txt.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

int main() {
  std::vector<uint64_t> a(128 << 20, 1);  // 1 GiB
  for (int r = 0; r < 30; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    uint64_t acc = 0;
#pragma omp parallel for reduction(+ : acc)
    for (size_t i = 0; i < a.size(); i += 8) acc += a[i];
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%.1f ", (1 << 30) / (ms * 1e6));
    std::fflush(stdout);
    if (acc == 0) std::printf("!");
  }
  std::printf("\n");
}
