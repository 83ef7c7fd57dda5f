// A/B in one loop: kCpuStream with moekit_ab_variant 0 and 1 in turn, group sizes routed (T
// tokens, k distinct experts of E each, uniform), weights cycled through cold copies.
//   ab K n T k E copies
#include <moekit/ragged_dot.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>
using namespace moekit;
extern "C" int moekit_ab_variant;
static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
int main(int argc, char** argv) {
  const int64_t K = atoi(argv[1]), n = atoi(argv[2]), T = atoi(argv[3]), k = atoi(argv[4]),
                E = atoi(argv[5]);
  const int copies = atoi(argv[6]);
  std::mt19937 rng(getenv("SEED") ? atoi(getenv("SEED")) : 7);
  std::vector<int32_t> sizes(E, 0);
  std::vector<int> ids(E);
  for (int64_t t = 0; t < T; ++t) {
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int64_t j = 0; j < k; ++j) ++sizes[ids[j]];
  }
  const int64_t m = T * k;
  std::vector<uint16_t> lhs(m * K, 0x3c00), out(m * n);
  std::vector<std::vector<uint16_t>> w(copies, std::vector<uint16_t>(E * K * n, 0x3c00));
  RaggedDotOptions o;
  o.impl = RaggedDotImpl::kCpuStream;
  const int reps = getenv("REPS") ? atoi(getenv("REPS")) : 9;
  std::vector<double> t0, t1;
  for (int rep = 0; rep < reps; ++rep) {
    for (int v : {0, 1}) {
      moekit_ab_variant = v;
      const double t = now();
      for (int c = 0; c < copies; ++c) {
        const Status s = ragged_dot(ConstTensorView(lhs.data(), DType::kBF16, {m, K}),
                                    ConstTensorView(w[c].data(), DType::kBF16, {E, K, n}), sizes,
                                    TensorView(out.data(), DType::kBF16, {m, n}), o);
        if (!s.ok()) return std::printf("error: %s\n", s.message().c_str()), 1;
      }
      (v ? t1 : t0).push_back((now() - t) / copies);
    }
  }
  std::sort(t0.begin(), t0.end());
  std::sort(t1.begin(), t1.end());
  std::printf("K %ld n %ld T %ld k %ld E %ld sizes", (long)K, (long)n, (long)T, (long)k, (long)E);
  for (auto s : sizes) std::printf(" %d", s);
  std::printf(": A %.2f ms, B %.2f ms, A/B %.3f\n", t0[reps / 2] * 1e3, t1[reps / 2] * 1e3,
              t0[reps / 2] / t1[reps / 2]);
}
