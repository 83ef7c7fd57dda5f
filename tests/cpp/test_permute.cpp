// Permutation tests: both implementations against an oracle written here from SPEC.md section 3
// (all routed slots sorted stably by expert, capacity applied per expert), adjoint identities
// for the backward passes, round trips, and every invalid input named with nothing written.
#include <gtest/gtest.h>
#include <hwy/targets.h>
#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "host_tensor.h"
#include "moekit/permute.h"
#include "routing_spread.h"

namespace moekit {
namespace {

constexpr PermuteImpl kImpls[] = {PermuteImpl::kThreaded, PermuteImpl::kReference};

struct Case {
  int64_t T, E;
  int32_t k;
  int64_t H;
  bool map_form = false;
  DType dtype = DType::kF32;
  Spread spread = Spread::kRandom;
  int64_t align = 1;
  double capacity_factor = 0.0;
  DropPolicy policy = DropPolicy::kProbs;
  bool pad_to_capacity = false;
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  std::string n = "T" + std::to_string(c.T) + "_E" + std::to_string(c.E) + "_k" +
                  std::to_string(c.k) + "_H" + std::to_string(c.H) +
                  (c.map_form ? "_map" : "_topk") + (c.dtype == DType::kBF16 ? "_bf16" : "") +
                  (c.spread == Spread::kHalfEmpty ? "_halfempty"
                   : c.spread == Spread::kAllOne  ? "_allone"
                                                  : "");
  if (c.align > 1) n += "_align" + std::to_string(c.align);
  if (c.capacity_factor > 0) {
    n += "_cap" + std::to_string(static_cast<int>(c.capacity_factor * 100)) +
         (c.policy == DropPolicy::kProbs ? "probs" : "position") +
         (c.pad_to_capacity ? "_padded" : "");
  }
  return n;
}

std::vector<std::vector<int32_t>> make_routing(const Case& c, std::mt19937& rng) {
  return spread_routing(c.spread, c.T, c.E, c.k, rng);
}

struct Expected {
  std::vector<int32_t> rows, experts;  // [T * S]
  std::vector<int32_t> tokens_per_expert, pad_offsets;
  std::vector<int64_t> src_token;  // [needed]: the token of each row, -1 for padding
  std::vector<int64_t> src_slot;
  int64_t needed = 0;
};

// SPEC section 3, directly: routed (token, slot) pairs sorted stably by expert; per expert keep
// at most capacity (highest prob first, ties to the earlier pair; or the earliest), in order.
Expected oracle(const Case& c, const HostTensor& routing, const HostTensor* probs) {
  const int64_t S = c.map_form ? c.E : c.k;
  Expected x;
  x.rows.assign(c.T * S, -1);
  x.experts.assign(c.T * S, -1);
  struct Pair {
    int64_t e, t, s;
  };
  std::vector<Pair> pairs;
  for (int64_t t = 0; t < c.T; ++t) {
    for (int64_t s = 0; s < S; ++s) {
      const int64_t e = c.map_form ? (routing.get({t, s}) != 0 ? s : -1)
                                   : static_cast<int64_t>(routing.get({t, s}));
      x.experts[t * S + s] = static_cast<int32_t>(e);
      if (e >= 0) pairs.push_back({e, t, s});
    }
  }
  std::stable_sort(pairs.begin(), pairs.end(),
                   [](const Pair& a, const Pair& b) { return a.e < b.e; });
  const int64_t capacity = c.capacity_factor > 0
                               ? static_cast<int64_t>(std::ceil(static_cast<double>(c.T) * c.k /
                                                                c.E * c.capacity_factor))
                               : -1;
  int64_t row = 0, pads = 0;
  size_t i = 0;
  for (int64_t e = 0; e < c.E; ++e) {
    std::vector<Pair> mine;
    for (; i < pairs.size() && pairs[i].e == e; ++i) mine.push_back(pairs[i]);
    if (capacity >= 0 && static_cast<int64_t>(mine.size()) > capacity) {
      std::vector<size_t> order(mine.size());
      std::iota(order.begin(), order.end(), 0);
      if (c.policy == DropPolicy::kProbs) {
        auto pr = [&](size_t j) { return probs->get({mine[j].t, mine[j].s}); };
        std::stable_sort(order.begin(), order.end(),
                         [&](size_t a, size_t b) { return pr(a) > pr(b); });
      }
      order.resize(capacity);
      std::sort(order.begin(), order.end());
      std::vector<Pair> kept;
      for (size_t j : order) kept.push_back(mine[j]);
      mine = kept;
    }
    const int64_t base = c.pad_to_capacity ? capacity : static_cast<int64_t>(mine.size());
    const int64_t block = (base + c.align - 1) / c.align * c.align;
    for (const Pair& pr : mine) {
      x.rows[pr.t * S + pr.s] = static_cast<int32_t>(row);
      x.src_token.push_back(pr.t);
      x.src_slot.push_back(pr.s);
      ++row;
    }
    for (int64_t r = static_cast<int64_t>(mine.size()); r < block; ++r) {
      x.src_token.push_back(-1);
      x.src_slot.push_back(-1);
      ++row;
    }
    x.tokens_per_expert.push_back(static_cast<int32_t>(block));
    x.pad_offsets.push_back(static_cast<int32_t>(pads));
    pads += block - static_cast<int64_t>(mine.size());
  }
  x.needed = row;
  return x;
}

PermuteOptions options_of(const Case& c, PermuteImpl impl) {
  PermuteOptions o;
  o.align_size = c.align;
  o.capacity_factor = c.capacity_factor;
  o.drop_policy = c.policy;
  o.pad_to_capacity = c.pad_to_capacity;
  o.k = c.k;
  o.impl = impl;
  return o;
}

class PermuteGrid : public testing::TestWithParam<Case> {};

TEST_P(PermuteGrid, MatchesOracleForwardBackwardAndAdjoints) {
  const Case& c = GetParam();
  const int64_t S = c.map_form ? c.E : c.k;
  std::mt19937 rng(static_cast<uint32_t>(c.T * 131 + c.E * 17 + c.k * 7 + c.H));
  const auto experts = make_routing(c, rng);
  HostTensor routing(c.map_form ? DType::kBool : DType::kI32, {c.T, S}, /*row_pad=*/1);
  HostTensor probs(c.dtype, {c.T, S});               // eighths: exact in bf16 too
  std::uniform_int_distribution<int> eighths(1, 8);  // ties on purpose
  for (int64_t t = 0; t < c.T; ++t) {
    if (c.map_form) {
      for (int64_t s = 0; s < S; ++s) routing.set({t, s}, 0);
      for (int32_t e : experts[t]) routing.set({t, e}, 1);
    } else {
      for (int32_t j = 0; j < c.k; ++j) routing.set({t, j}, experts[t][j]);
    }
    for (int64_t s = 0; s < S; ++s) probs.set({t, s}, eighths(rng) / 8.0);
  }
  HostTensor x(c.dtype, {c.T, c.H}, /*row_pad=*/3);
  x.fill_random(rng);
  const Expected want = oracle(c, routing, &probs);
  const int64_t max_rows = permute_max_rows(c.T, c.E, c.k, options_of(c, PermuteImpl::kAuto));
  ASSERT_GE(max_rows, want.needed);
  const int64_t N = max_rows;  // the fixed worst-case size: its unused tail must come out zero

  for (PermuteImpl impl : kImpls) {
    SCOPED_TRACE(impl == PermuteImpl::kThreaded ? "threaded" : "reference");
    HostTensor x_perm(c.dtype, {N, c.H}, 2), p_perm(c.dtype, {N}), tpe(DType::kI32, {c.E}),
        pad(DType::kI32, {c.E}), row_map(DType::kI32, {2, c.T, S});
    x_perm.fill(-9.0f);
    p_perm.fill(-9.0f);
    ASSERT_TRUE(permute(x.in(), routing.in(), probs.in(), options_of(c, impl),
                        {x_perm.mut(), p_perm.mut(), tpe.mut(), row_map.mut(), pad.mut()})
                    .ok());
    for (int64_t e = 0; e < c.E; ++e) {
      ASSERT_EQ(tpe.get({e}), want.tokens_per_expert[e]) << e;
      ASSERT_EQ(pad.get({e}), want.pad_offsets[e]) << e;
    }
    for (int64_t t = 0; t < c.T; ++t) {
      for (int64_t s = 0; s < S; ++s) {
        ASSERT_EQ(row_map.get({0, t, s}), want.rows[t * S + s]) << t << "," << s;
        ASSERT_EQ(row_map.get({1, t, s}), want.experts[t * S + s]) << t << "," << s;
      }
    }
    for (int64_t r = 0; r < N; ++r) {
      const int64_t t = r < want.needed ? want.src_token[r] : -1;
      const double pw = t < 0 ? 0.0 : probs.get({t, want.src_slot[r]});
      ASSERT_EQ(p_perm.get({r}), pw) << r;
      for (int64_t h = 0; h < c.H; ++h) {
        ASSERT_EQ(x_perm.get({r, h}), t < 0 ? 0.0 : x.get({t, h})) << r << "," << h;
      }
    }

    // unpermute with and without merging probs, against the oracle's sum in slot order.
    HostTensor y(c.dtype, {N, c.H});
    y.fill_random(rng);
    HostTensor out(DType::kF32, {c.T, c.H}, 1), out1(DType::kF32, {c.T, c.H});
    ASSERT_TRUE(unpermute(y.in(), row_map.in(), probs.in(), out.mut(), impl).ok());
    ASSERT_TRUE(unpermute(y.in(), row_map.in(), {}, out1.mut(), impl).ok());
    for (int64_t t = 0; t < c.T; ++t) {
      for (int64_t h = 0; h < c.H; ++h) {
        double sum = 0, sum1 = 0;
        for (int64_t s = 0; s < S; ++s) {
          const int32_t r = want.rows[t * S + s];
          if (r < 0) continue;
          sum += probs.get({t, s}) * y.get({r, h});
          sum1 += y.get({r, h});
        }
        ASSERT_NEAR(out.get({t, h}), sum, 1e-5) << t << "," << h;
        ASSERT_NEAR(out1.get({t, h}), sum1, 1e-5) << t << "," << h;
      }
    }
    if (c.dtype == DType::kBF16) {
      // An output in the rows' dtype holds the f32 result rounded once.
      HostTensor out_b(DType::kBF16, {c.T, c.H});
      ASSERT_TRUE(unpermute(y.in(), row_map.in(), probs.in(), out_b.mut(), impl).ok());
      for (int64_t t = 0; t < c.T; ++t) {
        for (int64_t h = 0; h < c.H; ++h) {
          ASSERT_EQ(out_b.get({t, h}), bf16_to_float(float_to_bf16(out.get({t, h})))) << t;
        }
      }
    }

    // Backward passes, by the adjoint identities <A v, g> = <v, A^T g>, in double:
    // permute (x -> x_perm, probs -> p_perm) and unpermute (y, w -> out).
    HostTensor g_perm(DType::kF32, {N, c.H}), g_p(DType::kF32, {N}), dx(DType::kF32, {c.T, c.H}),
        dprobs(DType::kF32, {c.T, S});
    g_perm.fill_random(rng);
    g_p.fill_random(rng);
    ASSERT_TRUE(
        permute_backward(g_perm.in(), g_p.in(), row_map.in(), dx.mut(), dprobs.mut(), impl).ok());
    double lhs = 0, rhs = 0;
    for (int64_t r = 0; r < N; ++r) {
      lhs += p_perm.get({r}) * g_p.get({r});
      for (int64_t h = 0; h < c.H; ++h) lhs += x_perm.get({r, h}) * g_perm.get({r, h});
    }
    for (int64_t t = 0; t < c.T; ++t) {
      for (int64_t s = 0; s < S; ++s) rhs += probs.get({t, s}) * dprobs.get({t, s});
      for (int64_t h = 0; h < c.H; ++h) rhs += x.get({t, h}) * dx.get({t, h});
    }
    ASSERT_NEAR(lhs, rhs, 1e-4 * (1 + std::fabs(lhs)));

    HostTensor g_out(DType::kF32, {c.T, c.H}), dy(DType::kF32, {N, c.H}, 1),
        dw(DType::kF32, {c.T, S});
    g_out.fill_random(rng);
    dy.fill(-9.0f);
    ASSERT_TRUE(
        unpermute_backward(g_out.in(), y.in(), row_map.in(), probs.in(), dy.mut(), dw.mut(), impl)
            .ok());
    double out_g = 0, y_dy = 0;
    for (int64_t t = 0; t < c.T; ++t) {
      for (int64_t h = 0; h < c.H; ++h) out_g += out.get({t, h}) * g_out.get({t, h});
    }
    for (int64_t r = 0; r < N; ++r) {
      const bool used = r < want.needed && want.src_token[r] >= 0;
      for (int64_t h = 0; h < c.H; ++h) {
        if (!used) ASSERT_EQ(dy.get({r, h}), 0.0) << r;  // padding and tail rows
        y_dy += y.get({r, h}) * dy.get({r, h});
      }
    }
    ASSERT_NEAR(out_g, y_dy, 1e-4 * (1 + std::fabs(out_g)));
    if (c.dtype == DType::kBF16) {
      HostTensor g_out_b(DType::kBF16, {c.T, c.H}), dy_b(DType::kBF16, {N, c.H}),
          dy_f(DType::kF32, {N, c.H});
      g_out_b.fill_random(rng);
      ASSERT_TRUE(
          unpermute_backward(g_out_b.in(), {}, row_map.in(), probs.in(), dy_b.mut(), {}, impl)
              .ok());
      ASSERT_TRUE(
          unpermute_backward(g_out_b.in(), {}, row_map.in(), probs.in(), dy_f.mut(), {}, impl)
              .ok());
      for (int64_t i = 0; i < N * c.H; ++i) {
        ASSERT_EQ(dy_b.get_flat(i), bf16_to_float(float_to_bf16(dy_f.get_flat(i)))) << i;
      }
    }
    // d merging_probs[t, s] = <y_perm[row], g_out[t]>.
    for (int64_t t = 0; t < c.T; ++t) {
      for (int64_t s = 0; s < S; ++s) {
        const int32_t r = want.rows[t * S + s];
        double d = 0;
        for (int64_t h = 0; r >= 0 && h < c.H; ++h) d += y.get({r, h}) * g_out.get({t, h});
        ASSERT_NEAR(dw.get({t, s}), d, 1e-4 * (1 + std::fabs(d))) << t << "," << s;
      }
    }
  }
}

std::vector<Case> grid() {
  std::vector<Case> cases;
  for (int64_t T : {0, 1, 5, 1000}) {
    for (int64_t E : {1, 8, 128}) {
      for (int32_t k : {1, 2, 8}) {
        cases.push_back({T, E, k, 7});
        if (k <= E) {
          Case m{T, E, k, 7};
          m.map_form = true;
          cases.push_back(m);
        }
        for (int64_t a : {16, 128}) {
          Case c{T, E, k, 7};
          c.align = a;
          cases.push_back(c);
        }
        for (double cf : {0.5, 1.0, 1.25}) {
          for (DropPolicy pol : {DropPolicy::kProbs, DropPolicy::kPosition}) {
            Case c{T, E, k, 7};
            c.capacity_factor = cf;
            c.policy = pol;
            c.spread = Spread::kHalfEmpty;  // some experts over capacity, some empty
            cases.push_back(c);
          }
        }
      }
    }
  }
  // Hidden sizes 1 and 2048, bf16, every token to one expert, map form with capacity, padding
  // to capacity with alignment.
  for (int64_t H : {1, 2048}) {
    cases.push_back({5, 8, 2, H});
    cases.push_back({1000, 128, 8, H, false, DType::kBF16});
  }
  // More routed slots per token than the vector kernels take at once (8), and a hidden size
  // with whole vector blocks and a tail.
  for (DType t : {DType::kF32, DType::kBF16}) {
    cases.push_back({77, 16, 13, 100, true, t});
    cases.push_back({77, 32, 11, 100, false, t});
  }
  Case one{1000, 8, 1, 7};
  one.spread = Spread::kAllOne;
  cases.push_back(one);
  one.capacity_factor = 1.25;
  cases.push_back(one);
  Case map_cap{1000, 128, 8, 7, true, DType::kBF16};
  map_cap.capacity_factor = 1.0;
  map_cap.spread = Spread::kHalfEmpty;
  cases.push_back(map_cap);
  Case padded{1000, 8, 2, 7};
  padded.capacity_factor = 1.0;
  padded.pad_to_capacity = true;
  padded.align = 16;
  padded.policy = DropPolicy::kPosition;
  padded.spread = Spread::kHalfEmpty;
  cases.push_back(padded);
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Permute, PermuteGrid, testing::ValuesIn(grid()), case_name);

TEST(Permute, RoundTripsGiveKTimesXAndXTimesSumOfProbs) {
  const int64_t T = 301, E = 64, H = 33;
  const int32_t k = 6;
  std::mt19937 rng(5);
  Case c{T, E, k, H};
  const auto experts = make_routing(c, rng);
  HostTensor idx(DType::kI32, {T, k}), w(DType::kF32, {T, k});
  HostTensor x(DType::kF32, {T, H});
  x.fill_random(rng);
  w.fill_random(rng);
  for (int64_t t = 0; t < T; ++t) {
    for (int32_t j = 0; j < k; ++j) idx.set({t, j}, experts[t][j]);
  }
  for (PermuteImpl impl : kImpls) {
    HostTensor x_perm(DType::kF32, {T * k, H}), tpe(DType::kI32, {E}),
        row_map(DType::kI32, {2, T, k});
    PermuteOptions o;
    o.impl = impl;
    ASSERT_TRUE(
        permute(x.in(), idx.in(), {}, o, {x_perm.mut(), {}, tpe.mut(), row_map.mut(), {}}).ok());
    int64_t total = 0;
    for (int64_t e = 0; e < E; ++e) total += static_cast<int64_t>(tpe.get({e}));
    EXPECT_EQ(total, T * k);
    HostTensor back(DType::kF32, {T, H}), merged(DType::kF32, {T, H});
    ASSERT_TRUE(unpermute(x_perm.in(), row_map.in(), {}, back.mut(), impl).ok());
    ASSERT_TRUE(unpermute(x_perm.in(), row_map.in(), w.in(), merged.mut(), impl).ok());
    for (int64_t t = 0; t < T; ++t) {
      double wsum = 0;
      for (int32_t j = 0; j < k; ++j) wsum += w.get({t, j});
      for (int64_t h = 0; h < H; ++h) {
        ASSERT_EQ(back.get({t, h}), k * x.get({t, h}));  // exact: bf16-exact values times 6
        ASSERT_NEAR(merged.get({t, h}), wsum * x.get({t, h}), 1e-5);
      }
    }
  }
}

TEST(Permute, PlanOnlyGivesCountsAndRowMap) {
  HostTensor idx(DType::kI32, {3, 2}), tpe(DType::kI32, {4}), row_map(DType::kI32, {2, 3, 2});
  const int32_t e[] = {3, 1, 1, 0, 3, 3};
  for (int i = 0; i < 6; ++i) idx.set_flat(i, e[i]);
  ASSERT_TRUE(permute({}, idx.in(), {}, {}, {{}, {}, tpe.mut(), row_map.mut(), {}}).ok());
  const int32_t counts[] = {1, 2, 0, 3};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(tpe.get({i}), counts[i]);
  // Expert 0: (1,1) -> 0; expert 1: (0,1), (1,0) -> 1, 2; expert 3: (0,0), (2,0), (2,1) -> 3..5.
  const int32_t rows[] = {3, 1, 2, 0, 4, 5};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(row_map.get_flat(i), rows[i]);
}

TEST(Permute, MaxRowsIsTheStatedBoundAndIsReached) {
  PermuteOptions o;
  EXPECT_EQ(permute_max_rows(10, 4, 2, o), 20);
  o.align_size = 8;
  EXPECT_EQ(permute_max_rows(10, 4, 2, o), (20 + 4 * 7) / 8 * 8);  // 48
  // Reached: counts 5, 5, 5, 5 each pad to 8 -> 32; counts 17, 1, 1, 1 -> 24 + 8 * 3 = 48.
  HostTensor idx(DType::kI32, {10, 2}), tpe(DType::kI32, {4}), row_map(DType::kI32, {2, 10, 2});
  for (int t = 0; t < 10; ++t) {
    idx.set({t, 0}, 0);
    idx.set({t, 1}, t < 7 ? 0 : t - 6);
  }
  ASSERT_TRUE(permute({}, idx.in(), {}, o, {{}, {}, tpe.mut(), row_map.mut(), {}}).ok());
  int64_t rows = 0;
  for (int e = 0; e < 4; ++e) rows += static_cast<int64_t>(tpe.get({e}));
  EXPECT_EQ(rows, 48);
  o = {};
  o.capacity_factor = 1.0;
  EXPECT_EQ(permute_max_rows(10, 4, 2, o), 20);  // capacity 5, at most 4 * 5
  o.capacity_factor = 0.5;
  EXPECT_EQ(permute_max_rows(10, 4, 2, o), 12);  // capacity 3
  o.pad_to_capacity = true;
  o.align_size = 4;
  EXPECT_EQ(permute_max_rows(10, 4, 2, o), 16);
  o.align_size = 0;
  EXPECT_EQ(permute_max_rows(10, 4, 2, o), -1);
}

TEST(Permute, RowOffsetsAreSixtyFourBitOnStridedViews) {
  // x and x_perm with a row stride of 2^30 bf16 elements: row 2 starts 2^31 elements (4 GiB)
  // in. The mappings are reserved, not touched, so only the pages of the rows used are memory.
  const int64_t stride = int64_t{1} << 30, T = 3, H = 8;
  const size_t bytes = static_cast<size_t>(2 * stride + H) * sizeof(bf16_bits);
  void* xs = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  void* ys = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(xs, MAP_FAILED);
  ASSERT_NE(ys, MAP_FAILED);
  auto* x = static_cast<bf16_bits*>(xs);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h)
      x[t * stride + h] = float_to_bf16(static_cast<float>(t * H + h));
  }
  const ConstTensorView xv = ConstTensorView(xs, DType::kBF16, {T, H}).with_stride(0, stride);
  const TensorView yv = TensorView(ys, DType::kBF16, {T, H}).with_stride(0, stride);
  HostTensor idx(DType::kI32, {T, 1}), tpe(DType::kI32, {2}), row_map(DType::kI32, {2, T, 1});
  idx.set({0, 0}, 1);  // token 0 -> row 2 (the last), tokens 1, 2 -> rows 0, 1
  idx.set({1, 0}, 0);
  idx.set({2, 0}, 0);
  for (PermuteImpl impl : kImpls) {
    PermuteOptions o;
    o.impl = impl;
    ASSERT_TRUE(permute(xv, idx.in(), {}, o, {yv, {}, tpe.mut(), row_map.mut(), {}}).ok());
    const auto* y = static_cast<const bf16_bits*>(ys);
    for (int64_t h = 0; h < H; ++h) {
      EXPECT_EQ(bf16_to_float(y[2 * stride + h]), static_cast<float>(h));
      EXPECT_EQ(bf16_to_float(y[0 * stride + h]), static_cast<float>(H + h));
      EXPECT_EQ(bf16_to_float(y[1 * stride + h]), static_cast<float>(2 * H + h));
    }
    HostTensor back(DType::kF32, {T, H});
    ASSERT_TRUE(unpermute(yv, row_map.in(), {}, back.mut(), impl).ok());
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < H; ++h) EXPECT_EQ(back.get({t, h}), t * H + h);
    }
  }
  munmap(xs, bytes);
  munmap(ys, bytes);
}

TEST(SortChunks, ReordersChunksAndTheInverseUndoesIt) {
  const int64_t H = 5, C = 7;
  std::mt19937 rng(9);
  std::vector<int32_t> sizes = {3, 0, 5, 1, 0, 4, 2};  // empty chunks too; 15 of 18 rows
  const int64_t N = 18;
  std::vector<int32_t> order(C);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  HostTensor split(DType::kI32, {C}), index(DType::kI32, {C}), x(DType::kBF16, {N, H}, 2),
      probs(DType::kF32, {N});
  for (int64_t c = 0; c < C; ++c) {
    split.set({c}, sizes[c]);
    index.set({c}, order[c]);
  }
  x.fill_random(rng);
  probs.fill_random(rng);
  std::vector<int64_t> offset(C, 0);
  for (int64_t c = 1; c < C; ++c) offset[c] = offset[c - 1] + sizes[c - 1];
  std::vector<int64_t> want;  // source row of each output row
  for (int32_t c : order) {
    for (int32_t i = 0; i < sizes[c]; ++i) want.push_back(offset[c] + i);
  }
  for (int64_t r = 15; r < N; ++r) want.push_back(r);
  for (PermuteImpl impl : kImpls) {
    HostTensor out(DType::kBF16, {N, H}), out_p(DType::kF32, {N}), back(DType::kBF16, {N, H}),
        back_p(DType::kF32, {N});
    ASSERT_TRUE(sort_chunks_by_index(x.in(), split.in(), index.in(), false, out.mut(), probs.in(),
                                     out_p.mut(), impl)
                    .ok());
    for (int64_t r = 0; r < N; ++r) {
      ASSERT_EQ(out_p.get({r}), probs.get({want[r]}));
      for (int64_t h = 0; h < H; ++h) ASSERT_EQ(out.get({r, h}), x.get({want[r], h}));
    }
    ASSERT_TRUE(sort_chunks_by_index(out.in(), split.in(), index.in(), true, back.mut(), out_p.in(),
                                     back_p.mut(), impl)
                    .ok());
    for (int64_t r = 0; r < N; ++r) {
      ASSERT_EQ(back_p.get({r}), probs.get({r}));
      for (int64_t h = 0; h < H; ++h) ASSERT_EQ(back.get({r, h}), x.get({r, h}));
    }
  }
}

TEST(Permute, Bf16RowsRoundToNearestEvenAndKeepNaN) {
  // The bf16 rows of unpermute_backward (w * d_out) and of unpermute (0 + w * y, one slot): rounded
  // as float_to_bf16 does, where rounding is easy to get wrong. With w = 1 + 2^-8: 1 * w is a tie
  // (to even: down), 3 * w rounds up, the largest finite bf16 times w overflows to inf; inf, NaN,
  // signed zeros and a subnormal too. A weight of NaN with every payload bit set: rounding its
  // bits up would carry into the sign. The values repeat over 9 x 12 lanes, so that the vector
  // kernels see them in whole blocks and in the tail.
  for (const float w : {1.0f + 0x1p-8f, std::bit_cast<float>(0x7fffffffu)}) {
    const float vals[] = {1.0f,       -1.0f, 3.0f, 0x1.fep127f, -0x1.fep127f, HUGE_VALF,
                          -HUGE_VALF, NAN,   0.0f, -0.0f,       0x1p-130f,    0.1f};
    const int64_t V = sizeof(vals) / sizeof(vals[0]), H = 9 * V;
    HostTensor d_out(DType::kBF16, {1, H}), row_map(DType::kI32, {2, 1, 1}),
        wt(DType::kF32, {1, 1});
    for (int64_t h = 0; h < H; ++h) d_out.set({0, h}, vals[h % V]);
    row_map.set({0, 0, 0}, 0);
    row_map.set({1, 0, 0}, 0);
    wt.set({0, 0}, w);
    for (PermuteImpl impl : kImpls) {
      HostTensor d_y(DType::kBF16, {1, H});
      ASSERT_TRUE(
          unpermute_backward(d_out.in(), {}, row_map.in(), wt.in(), d_y.mut(), {}, impl).ok());
      const auto* g = reinterpret_cast<const bf16_bits*>(d_out.bytes.data());
      const auto* got = reinterpret_cast<const bf16_bits*>(d_y.bytes.data());
      HostTensor out(DType::kBF16, {1, H});
      ASSERT_TRUE(unpermute(d_out.in(), row_map.in(), wt.in(), out.mut(), impl).ok());
      const auto* combined = reinterpret_cast<const bf16_bits*>(out.bytes.data());
      for (int64_t h = 0; h < H; ++h) {
        // NaN times NaN: which payload survives is the compiler's choice of operand order.
        if (std::isnan(w) && std::isnan(vals[h % V])) continue;
        const float product = w * bf16_to_float(g[h]);
        EXPECT_EQ(got[h], float_to_bf16(product)) << h;
        EXPECT_EQ(combined[h], float_to_bf16(0.0f + product)) << h;  // a sum: -0 becomes +0
      }
    }
  }
}

// The combine and dot kernels are compiled for every x86 target Highway knows, and the best the
// CPU supports runs everywhere else in these tests. Here each supported target runs unpermute
// and both backward passes against the reference: tokens routed to no expert, to every one (16,
// more than the kernels take at once), and a hidden size with whole vector blocks and a tail.
TEST(Permute, VectorKernelsAgreeWithTheReferenceOnEveryTarget) {
  const int64_t T = 41, E = 16, H = 101;
  std::mt19937 rng(17);
  HostTensor map(DType::kBool, {T, E}), probs(DType::kF32, {T, E});
  std::bernoulli_distribution coin(0.6);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) map.set({t, e}, t == 0 ? 0 : t == 1 ? 1 : coin(rng));
  }
  probs.fill_random(rng);
  const int64_t N = T * E;
  HostTensor tpe(DType::kI32, {E}), row_map(DType::kI32, {2, T, E});
  ASSERT_TRUE(permute({}, map.in(), {}, {}, {{}, {}, tpe.mut(), row_map.mut(), {}}).ok());
  HostTensor y(DType::kBF16, {N, H}), d_out(DType::kBF16, {T, H}), d_probs_perm(DType::kF32, {N});
  y.fill_random(rng);
  d_out.fill_random(rng);
  d_probs_perm.fill_random(rng);

  struct Outputs {
    HostTensor out{DType::kF32, {T, H}}, out_b{DType::kBF16, {T, H}}, d_y{DType::kBF16, {N, H}},
        d_w{DType::kF32, {T, E}}, d_x{DType::kF32, {T, H}}, d_p{DType::kF32, {T, E}};
  };
  auto run = [&](PermuteImpl impl, Outputs& o) {
    ASSERT_TRUE(unpermute(y.in(), row_map.in(), probs.in(), o.out.mut(), impl).ok());
    ASSERT_TRUE(unpermute(y.in(), row_map.in(), probs.in(), o.out_b.mut(), impl).ok());
    ASSERT_TRUE(unpermute_backward(d_out.in(), y.in(), row_map.in(), probs.in(), o.d_y.mut(),
                                   o.d_w.mut(), impl)
                    .ok());
    ASSERT_TRUE(
        permute_backward(y.in(), d_probs_perm.in(), row_map.in(), o.d_x.mut(), o.d_p.mut(), impl)
            .ok());
  };
  Outputs want;
  run(PermuteImpl::kReference, want);
  const auto targets = hwy::SupportedAndGeneratedTargets();
  ASSERT_GE(targets.size(), 2u);  // at least one vector target beside the baseline
  for (const int64_t target : targets) {
    SCOPED_TRACE(hwy::TargetName(target));
    hwy::SetSupportedTargetsForTest(target);
    Outputs got;
    run(PermuteImpl::kThreaded, got);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        const double o = want.out.get({t, h});
        ASSERT_NEAR(got.out.get({t, h}), o, 1e-5 * (1 + std::fabs(o))) << t << "," << h;
        // bf16: the f32 sum rounded once, where the two sums' last bits may round apart.
        ASSERT_NEAR(got.out_b.get({t, h}), o, 0x1p-8 * std::fabs(o) + 1e-5) << t << "," << h;
        ASSERT_NEAR(got.d_x.get({t, h}), want.d_x.get({t, h}), 1e-5) << t << "," << h;
      }
      for (int64_t e = 0; e < E; ++e) {
        const double w = want.d_w.get({t, e});
        ASSERT_NEAR(got.d_w.get({t, e}), w, 1e-5 * (1 + std::fabs(w))) << t << "," << e;
        ASSERT_EQ(got.d_p.get({t, e}), want.d_p.get({t, e})) << t << "," << e;
      }
    }
    for (int64_t i = 0; i < N * H; ++i) {
      ASSERT_EQ(got.d_y.get_flat(i), want.d_y.get_flat(i)) << i;
    }
  }
  hwy::SetSupportedTargetsForTest(0);  // back to what the CPU supports
}

// Outputs of 4 MiB and more are written with non-temporal stores, which need aligned rows: here
// both unpermute's output and unpermute_backward's d_y_perm are that large, in 64-byte aligned
// buffers, against the reference (which writes plainly).
TEST(Permute, LargeAlignedOutputsAreStreamedAndEqualTheReference) {
  const int64_t T = 2048, E = 16, H = 1024, N = 2 * T;
  const int32_t k = 2;
  std::mt19937 rng(23);
  Case c{T, E, k, H};
  const auto experts = make_routing(c, rng);
  HostTensor idx(DType::kI32, {T, k}), w(DType::kF32, {T, k}), tpe(DType::kI32, {E}),
      row_map(DType::kI32, {2, T, k}), y(DType::kBF16, {N, H}), d_out(DType::kBF16, {T, H});
  for (int64_t t = 0; t < T; ++t) {
    for (int32_t s = 0; s < k; ++s) idx.set({t, s}, experts[t][s]);
  }
  w.fill_random(rng);
  y.fill_random(rng);
  d_out.fill_random(rng);
  ASSERT_TRUE(permute({}, idx.in(), {}, {}, {{}, {}, tpe.mut(), row_map.mut(), {}}).ok());
  struct Aligned {
    explicit Aligned(size_t n) : p(static_cast<bf16_bits*>(std::aligned_alloc(64, 2 * n))) {}
    ~Aligned() { std::free(p); }
    bf16_bits* p;
  };
  Aligned out_ref(T * H), out(T * H), d_y_ref(N * H), d_y(N * H);
  HostTensor dw_ref(DType::kF32, {T, k}), dw(DType::kF32, {T, k});
  auto run = [&](PermuteImpl impl, bf16_bits* o, bf16_bits* dy, HostTensor& dwt) {
    ASSERT_TRUE(
        unpermute(y.in(), row_map.in(), w.in(), TensorView(o, DType::kBF16, {T, H}), impl).ok());
    ASSERT_TRUE(unpermute_backward(d_out.in(), y.in(), row_map.in(), w.in(),
                                   TensorView(dy, DType::kBF16, {N, H}), dwt.mut(), impl)
                    .ok());
  };
  run(PermuteImpl::kReference, out_ref.p, d_y_ref.p, dw_ref);
  // On every Highway target: SSE4's bf16 half vectors must not take Highway's 16-byte Stream.
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    hwy::SetSupportedTargetsForTest(target);
    run(PermuteImpl::kThreaded, out.p, d_y.p, dw);
    for (int64_t i = 0; i < T * H; ++i) {
      const float want = bf16_to_float(out_ref.p[i]);
      // Two sums of two products: the last bits may round apart.
      ASSERT_NEAR(bf16_to_float(out.p[i]), want, 0x1p-7 * std::fabs(want) + 1e-6) << i;
    }
    for (int64_t i = 0; i < N * H; ++i) ASSERT_EQ(d_y.p[i], d_y_ref.p[i]) << i;
    for (int64_t t = 0; t < T; ++t) {
      for (int32_t s = 0; s < k; ++s) {
        ASSERT_NEAR(dw.get({t, s}), dw_ref.get({t, s}), 1e-4 * (1 + std::fabs(dw_ref.get({t, s}))));
      }
    }
  }
  hwy::SetSupportedTargetsForTest(0);  // back to what the CPU supports
}

TEST(SortChunks, NoChunksAndOneChunkOfEveryRowCopyInPlace) {
  const int64_t N = 9, H = 3;
  std::mt19937 rng(2);
  HostTensor x(DType::kF32, {N, H});
  x.fill_random(rng);
  HostTensor none(DType::kI32, {0}), one(DType::kI32, {1}), zero(DType::kI32, {1});
  one.set({0}, static_cast<double>(N));
  zero.set({0}, 0);
  for (PermuteImpl impl : kImpls) {
    for (bool inverse : {false, true}) {
      HostTensor a(DType::kF32, {N, H}), b(DType::kF32, {N, H});
      ASSERT_TRUE(
          sort_chunks_by_index(x.in(), none.in(), none.in(), inverse, a.mut(), {}, {}, impl).ok());
      ASSERT_TRUE(
          sort_chunks_by_index(x.in(), one.in(), zero.in(), inverse, b.mut(), {}, {}, impl).ok());
      for (int64_t i = 0; i < N * H; ++i) {
        ASSERT_EQ(a.get_flat(i), x.get_flat(i));
        ASSERT_EQ(b.get_flat(i), x.get_flat(i));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Errors: named, and nothing written.

void expect_arg(const Status& s, const std::string& argument) {
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_EQ(s.argument(), argument) << s.message();
}

TEST(PermuteErrors, InvalidInputIsNamedAndNothingIsWritten) {
  const int64_t T = 6, E = 4, H = 3;
  const int32_t k = 2;
  HostTensor x(DType::kF32, {T, H}), idx(DType::kI32, {T, k}), probs(DType::kF32, {T, k});
  for (int64_t t = 0; t < T; ++t) {
    idx.set({t, 0}, 0);
    idx.set({t, 1}, 1 + t % 3);
  }
  HostTensor x_perm(DType::kF32, {T * k, H}), small(DType::kF32, {T * k - 1, H}),
      tpe(DType::kI32, {E}), row_map(DType::kI32, {2, T, k});
  x_perm.fill(-9.0f);
  small.fill(-9.0f);
  tpe.fill(-9.0f);
  row_map.fill(-9.0f);
  auto untouched = [&] {
    for (int64_t i = 0; i < T * k * H; ++i) ASSERT_EQ(x_perm.get_flat(i), -9.0);
    for (int64_t i = 0; i < (T * k - 1) * H; ++i) ASSERT_EQ(small.get_flat(i), -9.0);
    for (int64_t i = 0; i < E; ++i) ASSERT_EQ(tpe.get_flat(i), -9.0);
    for (int64_t i = 0; i < 2 * T * k; ++i) ASSERT_EQ(row_map.get_flat(i), -9.0);
  };
  const PermuteOutputs outs{x_perm.mut(), {}, tpe.mut(), row_map.mut(), {}};
  PermuteOptions o;
  // An output smaller than the routed count.
  expect_arg(permute(x.in(), idx.in(), {}, o, {small.mut(), {}, tpe.mut(), row_map.mut(), {}}),
             "out.x.shape");
  untouched();
  // An expert index out of range, found before anything is written.
  HostTensor bad = idx;
  bad.set({T - 1, 1}, E);
  expect_arg(permute(x.in(), bad.in(), {}, o, outs), "topk_indices[5, 1]");
  bad.set({T - 1, 1}, -1);
  expect_arg(permute(x.in(), bad.in(), {}, o, outs), "topk_indices[5, 1]");
  untouched();
  o.align_size = 0;
  expect_arg(permute(x.in(), idx.in(), {}, o, outs), "align_size");
  o = {};
  o.capacity_factor = -1;
  expect_arg(permute(x.in(), idx.in(), {}, o, outs), "capacity_factor");
  o.capacity_factor = 1.0;  // kProbs without probs
  expect_arg(permute(x.in(), idx.in(), {}, o, outs), "probs");
  o = {};
  o.pad_to_capacity = true;
  expect_arg(permute(x.in(), idx.in(), {}, o, outs), "pad_to_capacity");
  o = {};
  HostTensor map(DType::kBool, {T, E});
  o.capacity_factor = 1.0;
  o.drop_policy = DropPolicy::kPosition;
  expect_arg(permute(x.in(), map.in(), {}, o, outs), "k");  // a map and a capacity need k
  o = {};
  HostTensor f(DType::kF32, {T, k});
  expect_arg(permute(x.in(), f.in(), {}, o, outs), "routing.dtype");
  HostTensor wrong_probs(DType::kF32, {T, k + 1});
  expect_arg(permute(x.in(), idx.in(), wrong_probs.in(), o, outs), "probs.shape");
  HostTensor wrong_h(DType::kF32, {T * k, H + 1});
  expect_arg(permute(x.in(), idx.in(), {}, o, {wrong_h.mut(), {}, tpe.mut(), row_map.mut(), {}}),
             "out.x.shape");
  HostTensor bf(DType::kBF16, {T * k, H});
  expect_arg(permute(x.in(), idx.in(), {}, o, {bf.mut(), {}, tpe.mut(), row_map.mut(), {}}),
             "out.x.dtype");
  expect_arg(permute(x.in(), idx.in(), {}, o, {x_perm.mut(), {}, {}, row_map.mut(), {}}),
             "tokens_per_expert.rank");
  untouched();

  // A row map naming a row past y_perm, or one row twice.
  ASSERT_TRUE(permute(x.in(), idx.in(), {}, o, outs).ok());
  HostTensor out(DType::kF32, {T, H}), d_y(DType::kF32, {T * k, H});
  out.fill(-9.0f);
  d_y.fill(-9.0f);
  HostTensor bad_map = row_map;
  bad_map.set({0, 2, 1}, static_cast<double>(T * k));
  expect_arg(unpermute(x_perm.in(), bad_map.in(), {}, out.mut()), "row_map[0, 2, 1]");
  bad_map.set({0, 2, 1}, -2);
  expect_arg(permute_backward(x_perm.in(), {}, bad_map.in(), out.mut(), {}), "row_map[0, 2, 1]");
  bad_map = row_map;
  bad_map.set({0, 3, 0}, row_map.get({0, 1, 1}));
  expect_arg(unpermute_backward(out.in(), {}, bad_map.in(), {}, d_y.mut(), {}), "row_map[0, 3, 0]");
  HostTensor dw(DType::kF32, {T, k});
  expect_arg(unpermute_backward(out.in(), {}, row_map.in(), {}, d_y.mut(), dw.mut()), "y_perm");
  for (int64_t i = 0; i < T * H; ++i) ASSERT_EQ(out.get_flat(i), -9.0);
  for (int64_t i = 0; i < T * k * H; ++i) ASSERT_EQ(d_y.get_flat(i), -9.0);

  // sort_chunks_by_index: negative sizes, sizes past the rows, an index that is no permutation.
  HostTensor split(DType::kI32, {2}), index(DType::kI32, {2}), y(DType::kF32, {T, H});
  y.fill(-9.0f);
  split.set({0}, 2);
  split.set({1}, -1);
  index.set({0}, 1);
  index.set({1}, 0);
  expect_arg(sort_chunks_by_index(out.in(), split.in(), index.in(), false, y.mut()),
             "split_sizes[1]");
  split.set({1}, 5);
  expect_arg(sort_chunks_by_index(out.in(), split.in(), index.in(), false, y.mut()), "split_sizes");
  split.set({1}, 1);
  index.set({1}, 1);
  expect_arg(sort_chunks_by_index(out.in(), split.in(), index.in(), false, y.mut()),
             "sorted_index[1]");
  for (int64_t i = 0; i < T * H; ++i) ASSERT_EQ(y.get_flat(i), -9.0);
}

}  // namespace
}  // namespace moekit

// The names the errors give each implementation; "unknown" past the enum.
TEST(Permute, ImplNames) {
  EXPECT_STREQ(impl_name(moekit::PermuteImpl::kAuto), "auto");
  EXPECT_STREQ(impl_name(moekit::PermuteImpl::kCuda), "cuda");
  EXPECT_STREQ(impl_name(moekit::PermuteImpl::kThreaded), "threaded");
  EXPECT_STREQ(impl_name(moekit::PermuteImpl::kReference), "reference");
  EXPECT_STREQ(impl_name(static_cast<moekit::PermuteImpl>(9)), "unknown");
}
