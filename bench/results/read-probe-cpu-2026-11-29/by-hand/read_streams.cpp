#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
static volatile uint64_t sink;
template <int S, int PF = 0>
static void rd(const char* p, size_t bytes) {
  uint64_t total = 0;
#pragma omp parallel reduction(+ : total)
  {
    size_t n = omp_get_num_threads(), i = omp_get_thread_num();
    size_t words = bytes / 8, begin = words * i / n, end = words * (i + 1) / n;
    const uint64_t* w = (const uint64_t*)p;
    const size_t part = (end - begin) / (S * 8) * 8;
    uint64_t sum[8] = {};
    for (size_t j = 0; j < part; j += 8)
      for (size_t s = 0; s < S; ++s) {
        const uint64_t* q = w + begin + s * part + j;
        if constexpr (PF > 0) __builtin_prefetch(q + PF * 8, 0, 3);
        for (size_t u = 0; u < 8; ++u) sum[u] += q[u];
      }
    for (auto v : sum) total += v;
  }
  sink = total;
}
static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
int main(int argc, char** argv) {
  size_t total = atol(argv[1]) << 30;
  char* p = (char*)aligned_alloc(1 << 21, total);
#pragma omp parallel for
  for (size_t i = 0; i < total; i += 4096) memset(p + i, i & 255, 4096);
  size_t sub = 1ull << 30;
  std::vector<double> a, b, c, d, e, f, g;
  for (int rep = 0; rep < 5; ++rep) {
    double t0 = now();
    rd<1, 16>(p, total);
    e.push_back(total / (now() - t0) / 1e9);
    t0 = now();
    rd<1, 64>(p, total);
    f.push_back(total / (now() - t0) / 1e9);
    t0 = now();
    rd<2>(p, total);
    g.push_back(total / (now() - t0) / 1e9);
    double t = now();
    rd<1>(p, total);
    a.push_back(total / (now() - t) / 1e9);
    t = now();
    rd<4>(p, total);
    b.push_back(total / (now() - t) / 1e9);
    t = now();
    rd<1>(p, sub);
    c.push_back(sub / (now() - t) / 1e9);
    t = now();
    rd<4>(p, sub);
    d.push_back(sub / (now() - t) / 1e9);
  }
  auto med = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  printf("pf 1 KiB %.1f, pf 4 KiB %.1f, 2 streams %.1f\n", med(e), med(f), med(g));
  printf("%s GiB: 1 stream %.1f, 4 streams %.1f; first GiB: 1 stream %.1f, 4 streams %.1f GB/s\n",
         argv[1], med(a), med(b), med(c), med(d));
}
