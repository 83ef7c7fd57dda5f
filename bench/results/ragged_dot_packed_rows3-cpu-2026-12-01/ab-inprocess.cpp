// In-process A/B: packed forward, E experts [K, n], R rows each (uniform), cold weights
// (E large), variants alternating call by call. Variants: "pin,rows,noahead" triples.
#include <moekit/ragged_dot.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
extern "C" void x_set(int pin, int rows, int noahead);
extern "C" void x_halves(int h);
extern "C" void x_bycol(int h);
using namespace moekit;
int main(int argc, char** argv) {
  const int64_t K = atoll(argv[1]), n = atoll(argv[2]), E = atoll(argv[3]), R = atoll(argv[4]);
  const int reps = atoi(argv[5]);
  const bool bf16 = argv[6][0] == 'b';
  std::vector<int> vp, vr, vn, vh;
  for (int i = 7; i < argc; ++i) {
    int a, b, c, h = 0;
    sscanf(argv[i], "%d,%d,%d,%d", &a, &b, &c, &h);
    vp.push_back(a);
    vr.push_back(b);
    vn.push_back(c);
    vh.push_back(h);
  }
  const DType dt = bf16 ? DType::kBF16 : DType::kF32;
  auto ps = packed_rhs_shape(E, K, n, dt);
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
  o.rhs_packed = true;
  std::vector<std::vector<double>> t(vp.size());
  for (int i = 0; i < reps + 1; ++i)
    for (size_t v = 0; v < vp.size(); ++v) {
      x_set(vp[v], vr[v], vn[v]);
      x_halves(vh[v] % 10000);
      x_bycol(vh[v] >= 10000);
      auto t0 = std::chrono::steady_clock::now();
      auto s = ragged_dot(av, pv, sizes, ov, o);
      auto t1 = std::chrono::steady_clock::now();
      if (!s.ok()) {
        puts("call failed");
        return 1;
      }
      if (i >= 1) t[v].push_back(std::chrono::duration<double>(t1 - t0).count());
    }
  double flops = 2.0 * E * R * K * n, bytes = (double)pk.size();
  double base = 0;
  for (size_t v = 0; v < vp.size(); ++v) {
    std::sort(t[v].begin(), t[v].end());
    double med = t[v][t[v].size() / 2];
    if (v == 0) base = med;
    printf(
        "K %lld n %lld E %lld R %2lld %s [pin %d rows %d noahead %d halves %d]: %8.3f ms (%.2fx) "
        "%5.1f GFLOP/s %5.1f GB/s\n",
        (long long)K, (long long)n, (long long)E, (long long)R, bf16 ? "bf16" : "f32", vp[v], vr[v],
        vn[v], vh[v], med * 1e3, base / med, flops / med * 1e-9, bytes / med * 1e-9);
  }
}
