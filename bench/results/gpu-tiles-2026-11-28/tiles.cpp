// How much of a grouped GEMM's tiles is real work, by tile shape (issue 36, item 2): arithmetic
// on the group sizes `moekit bench ragged_dot` makes (imbalanced_group_sizes in
// tools/bench_common.cpp: rows in proportion to 1 + 0.25 u, u ~ U(-1, 1), seed 42), no GPU.
//   rows%:  the output elements the call needs over those its tiles compute (each group's last
//           row tile and last column tile partly empty);
//   waves%: the tiles over the tile slots of the waves they take (132 SMs, one tile each at a
//           time; 66 clusters of 2 for 256x128), as if every tile took the same time;
//   both%:  the two multiplied, an upper bound on the share of the tensor cores' rate left.
// fwd: [rows, K=H] x [H, n=F]; dlhs: [rows, F] x [F, H] (the bench's default matmul, "ffn").
// g++ -O2 -std=c++20 tiles.cpp -o tiles && ./tiles > tiles.txt
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <random>
#include <vector>

std::vector<int64_t> bench_sizes(int64_t rows, int64_t groups) {
  std::vector<int64_t> s(groups, 0);
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<double> w(groups);
  double total = 0;
  for (auto& x : w) total += (x = 1.0 + 0.25 * u(rng));
  int64_t assigned = 0;
  for (int64_t e = 0; e < groups; ++e) assigned += (s[e] = std::floor(rows * w[e] / total));
  for (int64_t e = 0; assigned < rows; e = (e + 1) % groups, ++assigned) ++s[e];
  return s;
}

struct Tile {
  const char* name;
  int64_t m, n, slots;
};

int main() {
  struct Preset {
    const char* name;
    int64_t h, f, e, k;
  };
  const Preset presets[] = {
      {"mixtral-8x7b", 4096, 14336, 8, 2},     {"qwen3-30b-a3b", 2048, 768, 128, 8},
      {"deepseek-v2-lite", 2048, 1408, 64, 6}, {"deepseek-v3", 7168, 2048, 256, 8},
      {"gpt-oss-20b", 2880, 2880, 32, 4},      {"olmoe-1b-7b", 2048, 1024, 64, 8}};
  const Tile tiles[] = {
      {"128x128", 128, 128, 132}, {"64x256", 64, 256, 132}, {"256x128 (2x1)", 256, 128, 66}};
  std::printf("%-36s", "");
  for (const Tile& t : tiles) std::printf(" | %-23s", t.name);
  std::printf("\n%-17s %6s %4s %5s", "preset", "tokens", "pass", "r/g");
  for (size_t i = 0; i < std::size(tiles); ++i)
    std::printf(" | %5s %7s %7s", "rows%", "waves%", "both%");
  std::printf("\n");
  for (const Preset& p : presets) {
    for (int64_t tokens : {512, 1024, 2048, 4096, 8192, 16384}) {
      const std::vector<int64_t> sizes = bench_sizes(tokens * p.k, p.e);
      for (const char* pass : {"fwd", "dlhs"}) {
        const int64_t n = pass[0] == 'f' ? p.f : p.h;
        std::printf("%-17s %6lld %4s %5lld", p.name, (long long)tokens, pass,
                    (long long)(tokens * p.k / p.e));
        for (const Tile& t : tiles) {
          int64_t count = 0;
          double real = 0, computed = 0;
          for (int64_t r : sizes) {
            const int64_t mt = (r + t.m - 1) / t.m, nt = (n + t.n - 1) / t.n;
            count += mt * nt;
            real += double(r) * n;
            computed += double(mt * t.m) * double(nt * t.n);
          }
          const int64_t waves = (count + t.slots - 1) / t.slots;
          const double rows = real / computed, fill = double(count) / double(waves * t.slots);
          std::printf(" | %5.1f %7.1f %7.1f", 100 * rows, 100 * fill, 100 * rows * fill);
        }
        std::printf("\n");
      }
    }
  }
}
