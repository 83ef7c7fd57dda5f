// By hand: the read rate of eight 256 MiB buffers, each allocated and filled in turn, read twice
// a round (the second timed), three rounds: in this VM (KVM) the first buffer read at ~21 GB/s and
// the others at 24-30, every round (read_placement.txt). Where a buffer lands decides its rate.
//   g++ -O2 -march=native -fopenmp read_placement.cpp -o read_placement; read_placement
#include <omp.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
volatile uint64_t sink;
double pread(const void* src, size_t bytes) {
  double t0 = omp_get_wtime();
  uint64_t total = 0;
#pragma omp parallel reduction(+ : total)
  {
    const size_t n = omp_get_num_threads(), i = omp_get_thread_num();
    const size_t words = bytes / 8, begin = words * i / n, end = words * (i + 1) / n;
    const auto* w = static_cast<const uint64_t*>(src);
    uint64_t part[8] = {};
    size_t j = begin;
    for (; j + 8 <= end; j += 8)
      for (size_t u = 0; u < 8; ++u) part[u] += w[j + u];
    for (uint64_t v : part) total += v;
  }
  sink = total;
  return bytes / (omp_get_wtime() - t0) / 1e9;
}
int main() {
  std::vector<char*> bufs;
  for (int i = 0; i < 8; ++i) {
    char* b = static_cast<char*>(aligned_alloc(64, 256u << 20));
    memset(b, 2, 256u << 20);
    bufs.push_back(b);
  }
  for (int r = 0; r < 3; ++r) {
    printf("round %d:", r);
    for (char* b : bufs) {
      pread(b, 256u << 20);
      printf(" %.1f", pread(b, 256u << 20));
    }
    printf("\n");
  }
}
