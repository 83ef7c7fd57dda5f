// The AMX tiles' rate on this machine, by hand: tdpbf16ps with no loads (the peak), and with the
// tile loads of the input gradient's two shapes from L1 (2 x 2: 4 loads per 4 products; 3 x 1: 4
// per 3), on 1 and 2 threads; then with the row tiles (the repacked rows: 2 x 2's two, 3 x 1's
// one) walking a buffer of 1 MiB a thread (L2), the weight tiles from L1, as in the kernel.
// g++ -O2 -std=c++20 -fopenmp -mamx-tile -mamx-bf16 -mavx512f amx_peak.cpp -o amx_peak &&
// ./amx_peak
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>

struct alignas(64) Cfg {
  uint8_t palette = 1, start = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

alignas(64) static uint16_t buf[2][8][16 * 32];  // a thread's tiles in L1
constexpr int64_t kL2Tiles = 1024;               // 1 MiB of 1 KiB tiles a thread
alignas(64) static uint16_t l2[2][kL2Tiles][16 * 32];

// 0: products only; 1: 2 x 2 with loads; 2: 3 x 1 with loads; 3: 2 x 2, row tiles from L2; 4: 3 x
// 1, row tile from L2
template <int kMode>
double run(int64_t iters) {
  double flop = 0;
  auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel reduction(+ : flop)
  {
    Cfg c;
    for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = 16;
    asm volatile("ldtilecfg %0" ::"m"(c));
    const int t = omp_get_thread_num();
    uint16_t(*b)[16 * 32] = buf[t];
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, b[4], 64);
    _tile_loadd(5, b[5], 64);
    _tile_loadd(6, b[6], 64);
    _tile_loadd(7, b[7], 64);
    for (int64_t i = 0; i < iters; ++i) {
      if (kMode == 3) {
        const int64_t r = (2 * i) % kL2Tiles;
        _tile_loadd(4, b[4], 64);
        _tile_loadd(5, b[5], 64);
        _tile_loadd(6, l2[t][r], 64);
        _tile_loadd(7, l2[t][r + 1], 64);
      }
      if (kMode == 4) {
        _tile_loadd(4, b[4], 64);
        _tile_loadd(5, b[5], 64);
        _tile_loadd(6, b[6], 64);
        _tile_loadd(7, l2[t][i % kL2Tiles], 64);
        _tile_dpbf16ps(0, 4, 7);
        _tile_dpbf16ps(1, 5, 7);
        _tile_dpbf16ps(2, 6, 7);
        flop += 3 * 2.0 * 16 * 16 * 32;
        continue;
      }
      if (kMode == 1) {
        _tile_loadd(4, b[4], 64);
        _tile_loadd(5, b[5], 64);
        _tile_loadd(6, b[6], 64);
        _tile_loadd(7, b[7], 64);
      }
      if (kMode == 2) {
        _tile_loadd(4, b[4], 64);
        _tile_loadd(5, b[5], 64);
        _tile_loadd(6, b[6], 64);
        _tile_loadd(7, b[7], 64);
        _tile_dpbf16ps(0, 4, 7);
        _tile_dpbf16ps(1, 5, 7);
        _tile_dpbf16ps(2, 6, 7);
        flop += 3 * 2.0 * 16 * 16 * 32;
        continue;
      }
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
      flop += 4 * 2.0 * 16 * 16 * 32;
    }
    alignas(64) float out[16][16];
    _tile_stored(0, out, 64);
    _tile_release();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return flop / s / 1e12;
}

int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 1;
  // Written, so that the buffer's pages are its own (an unwritten one reads the one zero page).
  for (auto& thread : l2) {
    for (auto& tile : thread) {
      for (uint16_t& x : tile) x = 0x3f80;
    }
  }
  const char* names[] = {"products only", "2 x 2, 4 loads per 4 products (L1)",
                         "3 x 1, 4 loads per 3 products (L1)", "2 x 2, row tiles from L2",
                         "3 x 1, row tile from L2"};
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    for (int rep = 0; rep < 3; ++rep) {
      std::printf("%d thread(s): %s %.2f, %s %.2f, %s %.2f, %s %.2f, %s %.2f TFLOP/s\n", threads,
                  names[0], run<0>(20000000), names[1], run<1>(20000000), names[2],
                  run<2>(20000000), names[3], run<3>(20000000), names[4], run<4>(20000000));
    }
  }
}
