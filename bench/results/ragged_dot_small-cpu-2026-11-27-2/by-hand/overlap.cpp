// Does a stream of weights from memory overlap with FMAs on this CPU? Each thread walks its half of
// a 512 MiB bf16 buffer 16 columns (32 bytes) a step, widens them to two f32 vectors and does R x 2
// FMAs with R row values held in registers (the 6 x 2 kernel's shape at R = 6). "mem": the buffer
// once; "l1": a 16 KiB piece walked over and over, as many steps (the FMAs alone); "read": the
// walk with no FMAs. PF: a prefetch of the line PF bytes ahead every 64 bytes (0: none).
//   overlap R:PF...   (R in 0, 1, 2, 4, 6, 8, 12)
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

template <int R>
__attribute__((noinline)) float walk(const uint16_t* w, size_t steps, const float* x, int pf) {
  __m256 acc[R][2];
  __m256 xb[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    xb[r] = _mm256_set1_ps(x[r]);
  }
  for (size_t s = 0; s < steps; ++s) {
    const uint16_t* p = w + s * 16;
    if (pf && (s & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(p) + pf, _MM_HINT_T0);
    __m256 b0 = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
    __m256 b1 = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))), 16));
    if constexpr (R == 0) {
      acc[0][0] = _mm256_add_ps(acc[0][0], b0);  // (R=0 path uses one adder; see below)
      acc[0][1] = _mm256_add_ps(acc[0][1], b1);
    } else {
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        acc[r][0] = _mm256_fmadd_ps(xb[r], b0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xb[r], b1, acc[r][1]);
      }
    }
  }
  __m256 t = _mm256_setzero_ps();
  for (int r = 0; r < (R ? R : 1); ++r) t = _mm256_add_ps(t, _mm256_add_ps(acc[r][0], acc[r][1]));
  alignas(32) float o[8];
  _mm256_store_ps(o, t);
  return o[0] + o[7];
}
// R = 0 needs acc[1][2]
template <>
__attribute__((noinline)) float walk<0>(const uint16_t* w, size_t steps, const float*, int pf) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t s = 0; s < steps; s += 2) {
    const uint16_t* p = w + s * 16;
    if (pf) _mm_prefetch(reinterpret_cast<const char*>(p) + pf, _MM_HINT_T0);
    a0 = _mm256_add_ps(
        a0, _mm256_castsi256_ps(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p))));
    a1 = _mm256_add_ps(
        a1, _mm256_castsi256_ps(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 8)))));
    a2 = _mm256_add_ps(
        a2, _mm256_castsi256_ps(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 16)))));
    a3 = _mm256_add_ps(
        a3, _mm256_castsi256_ps(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 24)))));
  }
  alignas(32) float o[8];
  _mm256_store_ps(o, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  return o[0];
}

using Fn = float (*)(const uint16_t*, size_t, const float*, int);
Fn pick(int r) {
  switch (r) {
    case 0:
      return walk<0>;
    case 1:
      return walk<1>;
    case 2:
      return walk<2>;
    case 4:
      return walk<4>;
    case 6:
      return walk<6>;
    case 8:
      return walk<8>;
    case 12:
      return walk<12>;
  }
  std::abort();
}

int main(int argc, char** argv) {
  const size_t bytes = size_t(512) << 20;  // 512 MiB
  const size_t elems = bytes / 2;
  std::vector<uint16_t> buf(elems);
  for (size_t i = 0; i < elems; ++i) buf[i] = 0x3f80 + (i & 7);
  float x[16];
  for (int i = 0; i < 16; ++i) x[i] = 1.0f + i * 1e-3f;
  const int threads = omp_get_max_threads();
  const int reps = 5;
  std::printf(
      "threads %d, buffer %zu MiB; per R: GB/s and GFLOP/s of mem / l1 / read, and mem's time over "
      "max(l1, read) and over l1 + read\n",
      threads, bytes >> 20);
  for (int argi = 1; argi < argc; ++argi) {
    int r = 0, pf = 0;
    std::sscanf(argv[argi], "%d:%d", &r, &pf);
    Fn f = pick(r), f0 = pick(0);
    double best[3] = {1e9, 1e9, 1e9};
    volatile float sink = 0;
    for (int rep = 0; rep < reps; ++rep) {
      for (int mode = 0; mode < 3; ++mode) {
        auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel
        {
          const int t = omp_get_thread_num();
          const size_t per = elems / threads;
          const uint16_t* base = buf.data() + t * per;
          const size_t steps = per / 16;
          float s = 0;
          if (mode == 0)
            s = f(base, steps, x, pf);
          else if (mode == 2)
            s = f0(base, steps, x, pf);
          else {  // l1: a 16 KiB piece walked over, the same number of steps
            const size_t piece = 16384 / 32;
            for (size_t done = 0; done < steps; done += piece) s += f(base, piece, x, 0);
          }
          sink = sink + s;
        }
        double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                        .count();
        if (ms < best[mode]) best[mode] = ms;
      }
    }
    const double flops = 2.0 * r * double(elems);
    std::printf(
        "R=%2d pf=%5d  mem %6.1f ms %5.1f GB/s %6.1f GF | l1 %6.1f ms %6.1f GF | read %6.1f ms "
        "%5.1f GB/s | mem/max %.2f mem/sum %.2f\n",
        r, pf, best[0], bytes / best[0] / 1e6, flops / best[0] / 1e6, best[1],
        flops / best[1] / 1e6, best[2], bytes / best[2] / 1e6, best[0] / std::max(best[1], best[2]),
        best[0] / (best[1] + best[2]));
  }
}
