// By hand: does a compute-bound group (the shared expert, all T rows) overlap with memory-bound
// routed groups when they run in one packed call? deepseek-v2-lite's gate|up at 64 tokens:
// 64 routed experts x 6 rows + 2 shared experts (2 x F = 2816) x 64 rows, as 66 groups of
// [2048, 2816] packed, against the same as two calls (routed, then shared).
#include <moekit/ragged_dot.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
using namespace moekit;
int main(int argc, char** argv) {
  const int64_t H = 2048, n = argc > 1 ? atoi(argv[1]) : 2816, E = 64,
                S = argc > 2 ? atoi(argv[2]) : 2, T = 64, r = 6;
  const int copies = 3, reps = 9;
  const PackedRhsShape ps = packed_rhs_shape(E + S, H, n, DType::kBF16);
  const int64_t per = ps.dims[0] * ps.dims[1] * ps.dims[2];
  std::vector<std::vector<uint16_t>> w(copies);
  for (auto& c : w) {
    c.resize(per);
    for (int64_t i = 0; i < per; ++i) c[i] = 0x3c00 + (i * 2654435761u >> 20) % 256;
  }
  const int64_t rows = E * r + S * T;
  std::vector<uint16_t> x(rows * H, 0x3c00), out(rows * n);
  std::vector<int32_t> all(E + S, r), routed(E, r), shared(S, T);
  for (int s = 0; s < S; ++s) all[E + s] = T;
  RaggedDotOptions o;
  o.rhs_packed = true;
  auto now = [] { return std::chrono::steady_clock::now(); };
  std::vector<double> ta, tb, tr, ts;
  int c = 0;
  for (int rep = 0; rep < reps + 1; ++rep) {
    for (int arm = 0; arm < 2; ++arm) {
      const uint16_t* wc = w[c++ % copies].data();
      auto t0 = now();
      if (arm == 0) {
        Status st = ragged_dot({x.data(), DType::kBF16, {rows, H}},
                               {wc, DType::kBF16, {E + S, ps.dims[1], ps.dims[2]}}, all,
                               {out.data(), DType::kBF16, {rows, n}}, o);
        if (!st.ok()) {
          printf("%s\n", st.message().c_str());
          return 1;
        }
        if (rep) ta.push_back(std::chrono::duration<double, std::milli>(now() - t0).count());
      } else {
        ragged_dot({x.data(), DType::kBF16, {E * r, H}},
                   {wc, DType::kBF16, {E, ps.dims[1], ps.dims[2]}}, routed,
                   {out.data(), DType::kBF16, {E * r, n}}, o);
        auto t1 = now();
        ragged_dot({x.data() + E * r * H, DType::kBF16, {S * T, H}},
                   {wc + E * ps.dims[1] * ps.dims[2], DType::kBF16, {S, ps.dims[1], ps.dims[2]}},
                   shared, {out.data() + E * r * n, DType::kBF16, {S * T, n}}, o);
        auto t2 = now();
        if (rep) {
          tb.push_back(std::chrono::duration<double, std::milli>(t2 - t0).count());
          tr.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
          ts.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
        }
      }
    }
  }
  auto med = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  printf(
      "n=%ld S=%ld: one call %.2f ms | two calls %.2f ms (routed %.2f + shared %.2f) | one/two "
      "%.3f\n",
      n, S, med(ta), med(tb), med(tr), med(ts), med(ta) / med(tb));
}
