#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
volatile uint64_t sink;
double rd(const uint64_t* w, size_t words) {
  auto t0 = std::chrono::steady_clock::now();
  uint64_t total = 0;
#pragma omp parallel reduction(+ : total)
  {
    size_t n = omp_get_num_threads(), i = omp_get_thread_num();
    size_t b = words * i / n, e = words * (i + 1) / n;
    uint64_t p[8] = {};
    for (size_t j = b; j + 8 <= e; j += 8)
      for (int u = 0; u < 8; ++u) p[u] += w[j + u];
    for (int u = 0; u < 8; ++u) total += p[u];
  }
  sink = total;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
int main() {
  for (size_t mb : {32, 64, 128, 256, 512, 1024, 3072}) {
    size_t bytes = mb << 20;
    uint64_t* w = (uint64_t*)aligned_alloc(4096, bytes);
    memset(w, 1, bytes);
    std::vector<double> t;
    for (int r = 0; r < 7; ++r) t.push_back(rd(w, bytes / 8));
    std::sort(t.begin(), t.end());
    printf("%5zu MB: %.1f GB/s (min time %.1f)\n", mb, bytes / t[3] / 1e9, bytes / t[0] / 1e9);
    free(w);
  }
}
