// In-process A/B: variants alternate call by call through x_sw (experiment*.diff; v % 100: the
// switch, v: block steps (0: the machine's), v >= 100000: one thread). Args: K n E R reps
// dtype(f/b) variants... Packed weights, or with UNPACKED set the plain [E, K, n] ([E, n, K] with
// TRANSPOSED: rhs_transposed).
#include <moekit/ragged_dot.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
namespace moekit::detail {
void set_packed_block_steps_for_test(int64_t steps);
}
using namespace moekit;
int main(int argc, char** argv) {
  const int64_t K = atoll(argv[1]), n = atoll(argv[2]), E = atoll(argv[3]), R = atoll(argv[4]);
  const int reps = atoi(argv[5]);
  const bool bf16 = argv[6][0] == 'b';
  std::vector<int> vs;
  for (int i = 7; i < argc; ++i) vs.push_back(atoi(argv[i]));
  const DType dt = bf16 ? DType::kBF16 : DType::kF32;
  const bool unpacked = getenv("UNPACKED") != nullptr, tr = getenv("TRANSPOSED") != nullptr;
  auto ps = packed_rhs_shape(E, K, n, dt);
  if (unpacked) ps.dims[0] = E, ps.dims[1] = tr ? n : K, ps.dims[2] = tr ? K : n;
  size_t es = bf16 ? 2 : 4;
  std::vector<char> pk(ps.dims[0] * ps.dims[1] * ps.dims[2] * es);
  for (size_t i = 0; i < pk.size(); i += 2) pk[i] = (char)(i * 7 % 13);
  std::vector<char> a(E * R * K * es);
  for (size_t i = 0; i < a.size(); i += 2) a[i] = (char)(i % 11);
  std::vector<float> out(E * R * n);
  std::vector<int32_t> sizes(E, R);
  TensorView pv(pk.data(), dt, {ps.dims[0], ps.dims[1], ps.dims[2]});
  ConstTensorView av(a.data(), dt, {E * R, K});
  TensorView ov(out.data(), DType::kF32, {E * R, n});
  RaggedDotOptions o;
  o.rhs_packed = !unpacked;
  o.rhs_transposed = tr;
  std::vector<std::vector<double>> t(vs.size());
  for (int i = 0; i < reps + 1; ++i)
    for (size_t v = 0; v < vs.size(); ++v) {
      moekit::detail::set_packed_block_steps_for_test(vs[v] % 100000);
      omp_set_num_threads(vs[v] >= 100000 ? 1 : 2);
      auto t0 = std::chrono::steady_clock::now();
      auto s = ragged_dot(av, pv, sizes, ov, o);
      auto t1 = std::chrono::steady_clock::now();
      if (!s.ok()) return 1;
      if (i >= 1) t[v].push_back(std::chrono::duration<double>(t1 - t0).count());
    }
  double flops = 2.0 * E * R * K * n, bytes = (double)pk.size(), base = 0;
  for (size_t v = 0; v < vs.size(); ++v) {
    std::sort(t[v].begin(), t[v].end());
    double med = t[v][t[v].size() / 2];
    if (v == 0) base = med;
    printf(
        "K %lld n %lld E %lld R %3lld %s [variant %d]: %8.3f ms (%.2fx) %5.1f GFLOP/s %5.1f GB/s\n",
        (long long)K, (long long)n, (long long)E, (long long)R, bf16 ? "bf16" : "f32", vs[v],
        med * 1e3, base / med, flops / med * 1e-9, bytes / med * 1e-9);
  }
}
