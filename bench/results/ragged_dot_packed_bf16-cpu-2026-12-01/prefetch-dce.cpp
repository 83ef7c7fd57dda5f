// GCC 12.2 (Debian 12) at -O2 deletes the prefetch below as dead code: `g++ -O2 -std=c++20 -S
// prefetch-dce.cpp -o - | grep -c prefetcht` prints 0; with -fno-tree-dce, 1; with either half of
// the test alone, 1. The packed kernels' prefetch_step had this form; WidePanel rewritten with a
// step lambda lost every prefetch this way, so the library now issues it as an asm statement
// (packed::prefetch_l2).
#include <cstdint>
struct Ahead {
  const char* p = nullptr;
  int64_t lines = 0;
  int shift = 0;
};
inline void pf_step(const Ahead& a, int64_t step) {
  const int64_t line = step >> a.shift;
  if (line < a.lines && line << a.shift == step) __builtin_prefetch(a.p + 64 * line, 0, 2);
}
__attribute__((noinline)) float f(const float* x, long n, Ahead ah) {
  float s = 0;
  for (long i = 0; i < n; ++i) {
    pf_step(ah, i);
    s += x[i];
  }
  return s;
}
