// How much of a grouped GEMM's tiles is real work, by tile shape (issue 36, item 2): arithmetic
// on the group sizes `moekit bench ragged_dot` makes (imbalanced_group_sizes in
// tools/bench_common.cpp: rows in proportion to 1 + 0.25 u, u ~ U(-1, 1), seed 42), no GPU.
//   rows%:  the output elements the call needs over those its tiles compute (each group's last
//           row tile and last column tile partly empty);
//   waves%: the tiles over the tile slots of the waves they take (132 SMs, one tile each at a
//           time; 66 clusters of 2 for 256x128), as if every tile took the same time;
//   both%:  the two multiplied, an upper bound on the share of the tensor cores' rate left.
// fwd: [rows, K=H] x [H, n=F]; dlhs: [rows, F] x [F, H] (the bench's default matmul, "ffn").
// Then the weight gradient's ([H, rows] x [rows, F] a group): its output tiles and their
// contraction, which is what a split of the contraction (split-K) would be for.
// g++ -O2 -std=c++20 tiles.cpp -o tiles && ./tiles > tiles.txt
// bench_sizes is a copy of tools/bench_common.cpp's imbalanced_group_sizes (the bench tool is an
// executable, no library to link), and the presets are bench/presets.json's shapes, so that this
// file builds alone.
#include <algorithm>
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
  std::printf(
      "\nweight gradient, 128x128 tiles: output tiles a group, in all, and SM waves (132); "
      "contraction steps of 64 rows a tile (the group's rows / 64: mean, least); its bf16 output "
      "(every group's [H, F]) written at an H200's 4.8 TB/s, against the dense matmul of the same "
      "FLOPs at 720 TFLOP/s (about the H200's measured cuBLAS rate): the share of the dense rate "
      "left if the write overlapped the products fully (max) or not at all (sum)\n");
  std::printf("%-17s %6s %7s %7s %7s %9s %9s %9s %9s %7s %7s\n", "preset", "tokens", "tiles/g",
              "tiles", "waves", "steps", "least", "write us", "dense us", "max%", "sum%");
  for (const Preset& p : presets) {
    for (int64_t tokens : {512, 4096, 16384}) {
      const std::vector<int64_t> sizes = bench_sizes(tokens * p.k, p.e);
      const int64_t per_group = (p.h + 127) / 128 * ((p.f + 127) / 128), all = per_group * p.e;
      int64_t least = sizes[0];
      for (int64_t r : sizes) least = r < least ? r : least;
      const double write_us = double(p.e * p.h * p.f * 2) / 4.8e12 * 1e6;
      const double dense_us = 2.0 * double(tokens * p.k) * double(p.h * p.f) / 720e12 * 1e6;
      std::printf("%-17s %6lld %7lld %7lld %7.1f %9.1f %9lld %9.1f %9.1f %7.1f %7.1f\n", p.name,
                  (long long)tokens, (long long)per_group, (long long)all, double(all) / 132,
                  double(tokens * p.k) / double(p.e) / 64, (long long)((least + 63) / 64), write_us,
                  dense_us, 100 * dense_us / std::max(dense_us, write_us),
                  100 * dense_us / (dense_us + write_us));
    }
  }
}
