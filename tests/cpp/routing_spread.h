// Test helper: the experts each token is routed to, for the permutation tests on the CPU
// (test_permute.cpp) and on CUDA (test_permute_cuda.cpp), with the spreads that make edge cases.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace moekit {

// kRandom: any expert; kHalfEmpty: the odd experts only (the even ones stay empty); kAllOne:
// every token to the last expert.
enum class Spread { kRandom, kHalfEmpty, kAllOne };

// The k experts of each of T tokens among E: distinct ones when k <= the experts on offer, else
// with repeats (a token naming its one expert k times), drawn from rng.
inline std::vector<std::vector<int32_t>> spread_routing(Spread spread, int64_t T, int64_t E,
                                                        int32_t k, std::mt19937& rng) {
  const int64_t pool = spread == Spread::kAllOne      ? 1
                       : spread == Spread::kHalfEmpty ? std::max<int64_t>(1, E / 2)
                                                      : E;
  std::vector<std::vector<int32_t>> r(T);
  std::vector<int32_t> experts(pool);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < pool; ++i) {
      experts[i] = static_cast<int32_t>(spread == Spread::kAllOne      ? E - 1
                                        : spread == Spread::kHalfEmpty ? (2 * i + 1) % E
                                                                       : i);
    }
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int32_t j = 0; j < k; ++j) r[t].push_back(experts[j % pool]);
  }
  return r;
}

}  // namespace moekit
