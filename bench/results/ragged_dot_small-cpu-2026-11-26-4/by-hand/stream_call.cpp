// By hand: one ragged_dot shape through the public API, every group the same size, the weights
// cycled through cold copies, beside a parallel read of 256 MiB timed in the same loop.
//
//   stream_call K n rows E copies [impl] [transposed]
//     impl: the RaggedDotImpl number (6 kCpuStream, 1 kOneDnn; 99: a plain parallel read of
//     the weights instead of the call); transposed: rhs [E, n, K] (the contraction-contiguous
//     form). Environment: F32=1 (f32 instead of bf16), REPS (default 15), NOPROBE=1, SPARSE=s
//     (rows in every s-th group only, the others empty: the weights' rate counts those groups).
// Prints the median call, the weights' bytes over it, the probe's rate and their ratio.
#include <moekit/ragged_dot.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

using namespace moekit;

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s K n rows E copies [impl] [transposed]\n", argv[0]);
    return 2;
  }
  const int64_t K = atoi(argv[1]), n = atoi(argv[2]), r = atoi(argv[3]), E = atoi(argv[4]);
  const int copies = atoi(argv[5]);
  const int impl = argc > 6 ? atoi(argv[6]) : 6;
  const bool transposed = argc > 7 && atoi(argv[7]) != 0;
  const bool f32 = getenv("F32") != nullptr;
  const DType dt = f32 ? DType::kF32 : DType::kBF16;
  const size_t es = f32 ? 4 : 2, elems = static_cast<size_t>(E * K * n);
  const int64_t sparse = getenv("SPARSE") ? atoi(getenv("SPARSE")) : 1;
  const int64_t busy = (E + sparse - 1) / sparse;
  const int64_t m = r * busy;
  std::vector<float> lhs(static_cast<size_t>(m * K), 1.f), out(static_cast<size_t>(m * n));
  std::vector<std::vector<char>> w(copies, std::vector<char>(elems * es, 0x3c));
  std::vector<int32_t> sizes(static_cast<size_t>(E), 0);
  for (int64_t e = 0; e < E; e += sparse) sizes[e] = static_cast<int32_t>(r);

  const size_t probe_bytes = size_t{256} << 20;
  std::vector<char> probe(probe_bytes, 1);
  auto read_rate = [&] {
    const double t = now();
    long s = 0;
#pragma omp parallel for reduction(+ : s)
    for (size_t i = 0; i < probe_bytes; i += 64) s += probe[i];
    if (s == 42) std::puts("");
    return probe_bytes / (now() - t) / 1e9;
  };

  RaggedDotOptions o;
  o.impl = static_cast<RaggedDotImpl>(impl);
  o.rhs_transposed = transposed;
  const int reps = getenv("REPS") ? atoi(getenv("REPS")) : 15;
  std::vector<double> ts, rs;
  for (int rep = 0; rep < reps; ++rep) {
    rs.push_back(getenv("NOPROBE") ? 1.0 : read_rate());
    const double t = now();
    for (int c = 0; c < copies; ++c) {
      if (impl == 99) {
        const auto* p = reinterpret_cast<const uint16_t*>(w[c].data());
        long tot = 0;
#pragma omp parallel for reduction(+ : tot) schedule(static)
        for (size_t i = 0; i < elems * es / 2; i += 32) tot += p[i];
        if (tot == 42) std::puts("");
        continue;
      }
      const ConstTensorView rv = transposed ? ConstTensorView(w[c].data(), dt, {E, n, K})
                                            : ConstTensorView(w[c].data(), dt, {E, K, n});
      const Status s = ragged_dot(ConstTensorView(lhs.data(), dt, {m, K}), rv, sizes,
                                  TensorView(out.data(), dt, {m, n}), o);
      if (!s.ok()) {
        std::printf("error: %s\n", s.message().c_str());
        return 1;
      }
    }
    ts.push_back((now() - t) / copies);
  }
  std::sort(ts.begin(), ts.end());
  std::sort(rs.begin(), rs.end());
  const double gb = static_cast<double>(elems * es) / 1e9 * busy / E, t = ts[reps / 2];
  std::printf(
      "K %ld n %ld r %ld E %ld impl %d: %.4f ms, %.1f GB/s weights, probe %.1f GB/s -> %.0f%%\n",
      static_cast<long>(K), static_cast<long>(n), static_cast<long>(r), static_cast<long>(E), impl,
      t * 1e3, gb / t, rs[reps / 2], 100 * gb / t / rs[reps / 2]);
}
