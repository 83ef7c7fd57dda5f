// How long the host takes this guest's core away: one busy loop timing the gaps between its
// steady_clock::now() calls for 3 s, counting those over 50 us. Run two at once, one per core:
//   g++ -O2 gaps.cpp -o gaps && (./gaps & ./gaps; wait)
// Output on the 2-core Xeon of this session (2026-11-28): gaps.txt.
#include <chrono>
#include <cstdio>

int main() {
  using C = std::chrono::steady_clock;
  auto start = C::now(), prev = start;
  int gaps = 0;
  double total = 0, worst = 0;
  while (C::now() - start < std::chrono::seconds(3)) {
    const auto t = C::now();
    const double us = std::chrono::duration<double, std::micro>(t - prev).count();
    if (us > 50) {
      gaps++;
      total += us;
      if (us > worst) worst = us;
    }
    prev = t;
  }
  std::printf("gaps>50us: %d, total %.1f ms of 3000, worst %.0f us\n", gaps, total / 1000, worst);
}
