// One sharded ragged_dot through the installed moekit, checked against plain loops: shard 1 of
// 2 of four experts, so groups 2 and 3 are local and the other rows must come out 0.
#include <moekit/ragged_dot.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

int main() {
  const int64_t m = 11, K = 5, n = 3, E = 4, E_loc = 2;
  const int32_t offset = 2;
  const std::vector<int32_t> sizes = {3, 0, 4, 2};  // 9 of the 11 rows grouped; 2 left over
  std::vector<float> lhs(m * K), rhs(E_loc * K * n), out(m * n, -1.0f);
  for (size_t i = 0; i < lhs.size(); ++i) lhs[i] = static_cast<float>(i % 7) - 3.0f;
  for (size_t i = 0; i < rhs.size(); ++i) rhs[i] = static_cast<float>(i % 5) * 0.5f - 1.0f;

  moekit::Status s = moekit::ragged_dot(
      moekit::ConstTensorView(lhs.data(), moekit::DType::kF32, {m, K}),
      moekit::ConstTensorView(rhs.data(), moekit::DType::kF32, {E_loc, K, n}), {sizes, offset},
      moekit::TensorView(out.data(), moekit::DType::kF32, {m, n}));
  if (!s.ok()) {
    std::fprintf(stderr, "ragged_dot failed: %s\n", s.message().c_str());
    return 1;
  }

  int64_t row = 0, wrong = 0;
  for (int64_t g = 0; g <= E; ++g) {  // g == E: the rows past sum(sizes)
    const int64_t rows = g < E ? sizes[g] : m - row;
    for (int64_t r = row; r < row + rows; ++r) {
      for (int64_t j = 0; j < n; ++j) {
        double want = 0.0;
        if (g >= offset && g < offset + E_loc) {
          for (int64_t k = 0; k < K; ++k)
            want += lhs[r * K + k] * rhs[((g - offset) * K + k) * n + j];
        }
        if (std::fabs(out[r * n + j] - want) > 1e-5) ++wrong;
      }
    }
    row += rows;
  }
  std::printf("moekit consumer: ragged_dot [%ld x %ld] shard of %ld experts: %ld wrong\n",
              static_cast<long>(m), static_cast<long>(n), static_cast<long>(E_loc),
              static_cast<long>(wrong));
  return wrong == 0 ? 0 : 1;
}
