// A parallel read of buffers of 8 MiB to 4 GiB: where reads leave the cache and run at memory
// speed on this VM (sysfs says a 480 MiB L3). Build: g++ -O2 -fopenmp -mavx512f read_sizes.cpp
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
int main() {
  for (size_t mb : std::initializer_list<size_t>{8, 32, 64, 128, 256, 384, 512, 1024, 4096}) {
    size_t n = mb << 20;
    char* p = (char*)aligned_alloc(4096, n);
    memset(p, 1, n);
    double best = 1e9;
    float sink = 0;
    for (int r = 0; r < (mb < 1024 ? 8 : 3); ++r) {
      auto t0 = std::chrono::steady_clock::now();
      float s = 0;
#pragma omp parallel for reduction(+ : s)
      for (size_t i = 0; i < n; i += 256) {
        __m512 a = _mm512_load_ps((float*)(p + i));
        __m512 b = _mm512_load_ps((float*)(p + i + 64));
        __m512 c = _mm512_load_ps((float*)(p + i + 128));
        __m512 d = _mm512_load_ps((float*)(p + i + 192));
        s += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d)));
      }
      double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0 && ms < best) best = ms;
      sink += s;
    }
    printf("%5zu MiB: %.1f GB/s (%g)\n", mb, n / best / 1e6, sink * 0);
    free(p);
  }
}
