#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
volatile float sink;
// E experts of rows x rowbytes; mode 0 sequential, 1 panel-strided (128B per row), 2
// strided+prefetch
double run(const char* w, int E, int rows, int rowb, int mode, int pf) {
  auto t0 = std::chrono::steady_clock::now();
  float tot = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : tot)
  for (int item = 0; item < E * (mode ? rowb / 128 : 1); ++item) {
    __m512 acc = _mm512_setzero_ps();
    if (mode == 0) {
      const char* b = w + (size_t)item * rows * rowb;
      for (size_t o = 0; o < (size_t)rows * rowb; o += 64)
        acc = _mm512_add_ps(acc, _mm512_load_ps((const float*)(b + o)));
    } else {
      int e = item / (rowb / 128), p = item % (rowb / 128);
      const char* b = w + (size_t)e * rows * rowb + p * 128;
      for (int r = 0; r < rows; ++r) {
        if (pf) {
          _mm_prefetch(b + (size_t)(r + pf) * rowb, _MM_HINT_T0);
          _mm_prefetch(b + (size_t)(r + pf) * rowb + 64, _MM_HINT_T0);
        }
        acc = _mm512_add_ps(acc, _mm512_load_ps((const float*)(b + (size_t)r * rowb)));
        acc = _mm512_add_ps(acc, _mm512_load_ps((const float*)(b + (size_t)r * rowb + 64)));
      }
    }
    tot += _mm512_reduce_add_ps(acc);
  }
  sink = tot;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
int main() {
  int E = 128, rows = 2048, rowb = 1536;
  size_t bytes = (size_t)E * rows * rowb;
  char* w = (char*)aligned_alloc(1 << 21, bytes + (1 << 22));
  memset(w, 1, bytes + (1 << 22));
  for (int mode = 0; mode < 2; ++mode)
    for (int pf : {0, 8, 16, 32}) {
      if (mode == 0 && pf) continue;
      std::vector<double> t;
      for (int r = 0; r < 7; ++r) t.push_back(run(w, E, rows, rowb, mode, pf));
      std::sort(t.begin(), t.end());
      printf("mode %d pf %2d: %.1f GB/s\n", mode, pf, bytes / t[3] / 1e9);
    }
}
