// A/B/C... in one loop: kCpuStream with moekit_ab_variant set to each listed variant in turn (a
// temporary knob in the library while measuring), group sizes routed (T tokens, k distinct experts
// of E each, uniform; EVEN=1: spread evenly; SPREAD=x: moekit bench's sizes at --imbalance x),
// bf16, one copy of the weights (larger than the last-level cache for the shapes measured here);
// beside them each rep, a parallel read of 256 MiB (the read rate of the moment). Prints each
// variant's median ms and its share of the floor max(weights / read rate, FLOPs / dense) with the
// dense rate given. WARM=1: no read beside the calls (weights that fit a cache stay there; the
// floor then is the read of the last run before, meaningless: compare the ms).
//   ab fwd|dlhs K n T k E dense_tflops variant...
#include <moekit/ragged_dot.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>
using namespace moekit;
extern "C" int moekit_ab_variant;
static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
static double read_rate(const std::vector<uint64_t>& buf) {
  const double t = now();
  uint64_t sum = 0;
#pragma omp parallel for reduction(+ : sum) schedule(static)
  for (size_t i = 0; i < buf.size(); ++i) sum += buf[i];
  const double s = now() - t;
  if (sum == 1) std::printf(" ");
  return buf.size() * 8 / s / 1e9;
}
static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
int main(int argc, char** argv) {
  if (argc < 9) return std::printf("ab fwd|dlhs K n T k E dense_tflops variant...\n"), 1;
  const bool fwd = std::strcmp(argv[1], "fwd") == 0;
  const int64_t K = atoi(argv[2]), n = atoi(argv[3]), T = atoi(argv[4]), k = atoi(argv[5]),
                E = atoi(argv[6]);
  const double dense = atof(argv[7]) * 1e12;
  std::vector<int> variants;
  for (int i = 8; i < argc; ++i) variants.push_back(atoi(argv[i]));
  std::mt19937 rng(getenv("SEED") ? atoi(getenv("SEED")) : 7);
  std::vector<int32_t> sizes(E, 0);
  std::vector<int> ids(E);
  for (int64_t t = 0; t < T; ++t) {
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int64_t j = 0; j < k; ++j) ++sizes[ids[j]];
  }
  if (getenv("EVEN") != nullptr) {  // the bench's spread: T * k rows over the E groups evenly
    for (int64_t j = 0; j < E; ++j)
      sizes[j] = static_cast<int32_t>(T * k * (j + 1) / E - T * k * j / E);
  }
  if (getenv("SPREAD") != nullptr) {  // moekit bench's sizes: --imbalance SPREAD, --seed 42
    std::mt19937_64 r64(42);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    std::vector<double> wt(E);
    double total = 0;
    for (auto& x : wt) total += (x = 1.0 + atof(getenv("SPREAD")) * u(r64));
    int64_t assigned = 0;
    for (int64_t j = 0; j < E; ++j) {
      sizes[j] = static_cast<int32_t>(std::floor(T * k * wt[j] / total));
      assigned += sizes[j];
    }
    for (int64_t j = 0; assigned < T * k; j = (j + 1) % E, ++assigned) ++sizes[j];
  }
  const int64_t m = T * k;
  // 64-byte aligned, as moekit bench's buffers (std::vector's 16-byte alignment puts every
  // weight row across cache lines and ran the input gradient 1.5x slower); OFFSET=b moves the
  // weights b bytes off it. DTYPE=f32: f32 operands (bf16 otherwise); the output the same.
  const bool f32 = getenv("DTYPE") != nullptr && std::strcmp(getenv("DTYPE"), "f32") == 0;
  const DType dt = f32 ? DType::kF32 : DType::kBF16;
  const size_t es = f32 ? 4 : 2;
  const size_t offset = getenv("OFFSET") ? atoi(getenv("OFFSET")) : 0;
  // THP=1: the buffers 2 MiB aligned and advised to take transparent huge pages.
  const bool thp = getenv("THP") != nullptr && atoi(getenv("THP")) == 1;
  auto buffer = [&](size_t elems) {
    const size_t align = thp ? size_t{2} << 20 : 64;
    const size_t bytes = (elems * es + 127 + align - 1) / align * align;
    auto* p = static_cast<char*>(std::aligned_alloc(align, bytes));
    if (thp) madvise(p, bytes, MADV_HUGEPAGE);
    for (size_t i = 0; i < elems + 32 / es; ++i) {
      if (f32) {
        reinterpret_cast<float*>(p)[i] = 1.0f;
      } else {
        reinterpret_cast<uint16_t*>(p)[i] = 0x3f80;
      }
    }
    return p;
  };
  char *x = buffer(m * K), *y = buffer(m * n), *w = buffer(E * K * n) + offset;
  std::vector<uint64_t> buf((256u << 20) / 8, 1);
  RaggedDotOptions o;
  o.impl = RaggedDotImpl::kCpuStream;
  o.rhs_transposed = getenv("TRANSPOSED") != nullptr;  // weights [E, n, K]
  const int reps = getenv("REPS") ? atoi(getenv("REPS")) : 9;
  std::vector<std::vector<double>> ms(variants.size());
  std::vector<double> bw;
  int64_t busy = 0;
  for (auto s : sizes) busy += s > 0;
  const double bytes = double(busy) * K * n * es, flops = 2.0 * m * K * n;
  for (int rep = 0; rep < reps + 1; ++rep) {
    const double rate = getenv("WARM") != nullptr ? 1.0 : read_rate(buf);
    for (size_t i = 0; i < variants.size(); ++i) {
      moekit_ab_variant = variants[i];
      const double t = now();
      const ConstTensorView rhs =
          o.rhs_transposed ? ConstTensorView(w, dt, {E, n, K}) : ConstTensorView(w, dt, {E, K, n});
      const Status s =
          fwd ? ragged_dot(ConstTensorView(x, dt, {m, K}), rhs, sizes, TensorView(y, dt, {m, n}), o)
              : ragged_dot_dlhs(ConstTensorView(y, dt, {m, n}), rhs, sizes,
                                TensorView(x, dt, {m, K}), o);
      if (!s.ok()) return std::printf("error: %s\n", s.message().c_str()), 1;
      if (rep > 0) ms[i].push_back((now() - t) * 1e3);  // rep 0 warms up
    }
    if (rep > 0) bw.push_back(rate);
  }
  const double floor_ms = std::max(bytes / (median(bw) * 1e9), flops / dense) * 1e3;
  std::printf("%s K %ld n %ld T %ld k %ld E %ld (%ld busy groups): read %.1f GB/s, floor %.2f ms |",
              argv[1], (long)K, (long)n, (long)T, (long)k, (long)E, (long)busy, median(bw),
              floor_ms);
  for (size_t i = 0; i < variants.size(); ++i)
    std::printf(" v%d %.3f ms %.1f%%", variants[i], median(ms[i]), 100 * floor_ms / median(ms[i]));
  std::printf("\n");
}
