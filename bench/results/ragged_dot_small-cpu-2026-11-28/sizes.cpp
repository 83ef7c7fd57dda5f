// ragged_dot forward on given group sizes, cold weights (cycling copies), beside a parallel read.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "moekit/ragged_dot.h"
using namespace moekit;
static double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
int main(int argc, char** argv) {
  // usage: sizes K n copies "s1,s2,..." [reps]
  int64_t K = atoll(argv[1]), n = atoll(argv[2]);
  int copies = atoi(argv[3]);
  std::vector<int32_t> sizes;
  {
    std::stringstream ss(argv[4]);
    std::string t;
    while (std::getline(ss, t, ','))
      if (!t.empty()) sizes.push_back(atoi(t.c_str()));
  }
  int reps = argc > 5 ? atoi(argv[5]) : 7;
  int64_t E = sizes.size(), m = 0;
  for (int s : sizes) m += s;
  std::vector<std::vector<uint16_t>> w(copies);
  for (auto& c : w) {
    c.resize(E * K * n);
    for (size_t i = 0; i < c.size(); ++i) c[i] = 0x3c00 + (i * 7 % 64);
  }
  std::vector<uint16_t> x(m * K, 0x3f80), out(m * n);
  int64_t touched = 0;
  for (int s : sizes) touched += s > 0;
  double bytes = double(touched) * K * n * 2;
  std::vector<std::string> cfgs;
  {
    std::stringstream ss(getenv("XCFG") ? getenv("XCFG") : "8");
    std::string t;
    while (std::getline(ss, t, ',')) cfgs.push_back(t);
  }
  std::vector<std::vector<double>> tc(cfgs.size());
  std::vector<double> t_call, t_read;
  volatile float sink = 0;
  for (int r = 0; r < (reps + 1) * (int)cfgs.size(); ++r) {
    const int ci = r % cfgs.size();
    setenv("XAMXMIN", cfgs[ci].c_str(), 1);
    auto& c = w[r % copies];
    RaggedDotImpl ran;
    RaggedDotOptions o;
    o.ran = &ran;
    double t0 = now_ms();
    Status s = ragged_dot(ConstTensorView(x.data(), DType::kBF16, {m, K}),
                          ConstTensorView(c.data(), DType::kBF16, {E, K, n}), sizes,
                          TensorView(out.data(), DType::kBF16, {m, n}), o);
    double t1 = now_ms();
    if (!s.ok()) {
      printf("error\n");
      return 1;
    }
    auto& d = w[(r + copies - 1) % copies];
    const int64_t words = d.size() / 32;
    double t2 = now_ms();
    float acc = 0;
#pragma omp parallel for reduction(+ : acc)
    for (int64_t i = 0; i < words; ++i) acc += d[i * 32];
    sink = sink + acc;
    double t3 = now_ms();
    if (r >= (int)cfgs.size()) {
      tc[ci].push_back(t1 - t0);
      t_read.push_back(t3 - t2);
    }
    if (r == 0) printf("ran %s\n", impl_name(ran));
  }
  std::sort(t_read.begin(), t_read.end());
  double rd = t_read[t_read.size() / 2];
  for (size_t ci = 0; ci < cfgs.size(); ++ci) {
    auto& t_call = tc[ci];
    std::sort(t_call.begin(), t_call.end());
    double c = t_call[t_call.size() / 2];
    printf("[%s] min %.2f ", cfgs[ci].c_str(), t_call[0]);
    double rate = double(w[0].size()) * 2 / (rd * 1e6);
    printf("call %.2f ms  read %.1f GB/s  floor %.2f ms  share %.0f%%\n", c, rate,
           bytes / (rate * 1e6), 100 * bytes / (rate * 1e6) / c);
  }
}
