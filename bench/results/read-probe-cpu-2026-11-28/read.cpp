// Read rate of a 1 GiB buffer on all threads: each thread's range read as S interleaved streams.
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
volatile uint64_t sink;
double run(const uint64_t* w, size_t words, int S) {
  auto t0 = std::chrono::steady_clock::now();
  uint64_t total = 0;
#pragma omp parallel reduction(+ : total)
  {
    const size_t n = omp_get_num_threads(), i = omp_get_thread_num();
    const size_t begin = words * i / n, end = words * (i + 1) / n, len = (end - begin) / S / 8 * 8;
    uint64_t part[8] = {};
    for (size_t j = 0; j < len; j += 8)
      for (int s = 0; s < S; ++s) {
        const uint64_t* p = w + begin + s * len + j;
        for (int u = 0; u < 8; ++u) part[u] += p[u];
      }
    for (auto v : part) total += v;
  }
  sink = total;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
int main() {
  const size_t bytes = size_t{1} << 30, words = bytes / 8;
  std::vector<uint64_t*> bufs;
  for (int c = 0; c < 2; ++c) {
    auto* b = static_cast<uint64_t*>(std::aligned_alloc(4096, bytes));
    std::memset(b, c + 1, bytes);
    bufs.push_back(b);
  }
  for (int round = 0; round < 3; ++round)
    for (int S : {1, 2, 4, 8, 16, 32}) {
      double best = 1e9;
      for (int r = 0; r < 3; ++r) best = std::min(best, run(bufs[r % 2], words, S));
      std::printf("round %d streams/thread %2d: %.1f GB/s\n", round, S, bytes / best / 1e9);
    }
}
