// The router and its losses against an oracle written here from SPEC.md section 2 in double
// precision, for both implementations (vectorised and scalar reference). Gradients are checked
// against central finite differences of the oracle.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "host_tensor.h"
#include "moekit/router.h"
#include "router_oracle.h"

namespace moekit {
namespace {

using namespace router_oracle;  // NOLINT(google-build-using-namespace): the oracle is the test's

constexpr RouterImpl kImpls[] = {RouterImpl::kVectorized, RouterImpl::kReference};
const char* impl_tag(RouterImpl i) { return i == RouterImpl::kReference ? "ref" : "vec"; }

// ---------------------------------------------------------------------------------------------
// route and route_backward over the grid.

enum class Variant { kSoftmaxPost, kSoftmaxPre, kSigmoid, kSqrtSoftplus };

struct GridCase {
  Variant variant;
  bool groups, bias;
  double scale;
  int64_t E;
  int32_t k;
  int64_t T;
};

std::string case_name(const testing::TestParamInfo<GridCase>& info) {
  const GridCase& c = info.param;
  const char* v[] = {"softmax_post", "softmax_pre", "sigmoid", "sqrtsoftplus"};
  return fmt::format("{}_{}_{}_s{}_E{}_k{}_T{}", v[static_cast<int>(c.variant)],
                     c.groups ? "groups" : "nogroups", c.bias ? "bias" : "nobias",
                     c.scale == 1.0 ? "1" : "2p5", c.E, c.k, c.T);
}

// Smallest group_topk in [1, G] that divides k with k / group_topk experts per group available;
// 0 when there is none.
int32_t pick_group_topk(int64_t E, int32_t k, int32_t G) {
  for (int32_t gt = 1; gt <= G; ++gt) {
    if (k % gt == 0 && k / gt <= E / G) return gt;
  }
  return 0;
}

std::vector<GridCase> grid() {
  std::vector<GridCase> cases;
  for (Variant v :
       {Variant::kSoftmaxPost, Variant::kSoftmaxPre, Variant::kSigmoid, Variant::kSqrtSoftplus}) {
    const bool softmax = v == Variant::kSoftmaxPost || v == Variant::kSoftmaxPre;
    for (bool groups : {false, true}) {
      for (bool bias : {false, true}) {
        if (bias && softmax) continue;  // a bias is for sigmoid-family scores only
        for (double scale : {1.0, 2.5}) {
          for (int64_t E : {1, 8, 64, 128, 256}) {
            for (int32_t k : {1, 2, 6, 8}) {
              if (k > E) continue;  // E = 1: every token to the one expert
              if (groups && (E < 4 || pick_group_topk(E, k, 4) == 0)) continue;
              for (int64_t T : {1, 3, 1000}) cases.push_back({v, groups, bias, scale, E, k, T});
            }
          }
        }
      }
    }
  }
  return cases;
}

Options options_of(const GridCase& c, std::mt19937& rng) {
  Options o;
  o.score = c.variant == Variant::kSigmoid        ? RouterScore::kSigmoid
            : c.variant == Variant::kSqrtSoftplus ? RouterScore::kSqrtSoftplus
                                                  : RouterScore::kSoftmax;
  o.pre_softmax = c.variant == Variant::kSoftmaxPre;
  o.k = c.k;
  o.scale = c.scale;
  if (c.groups) {
    o.num_groups = 4;
    o.group_topk = pick_group_topk(c.E, c.k, 4);
  }
  if (c.bias) {
    std::uniform_real_distribution<float> u(-0.1f, 0.1f);
    for (int64_t e = 0; e < c.E; ++e) o.bias.push_back(u(rng));
  }
  return o;
}

class RouteGrid : public testing::TestWithParam<GridCase> {};

TEST_P(RouteGrid, ForwardAndBackwardMatchOracle) {
  const GridCase c = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(c.E * 131 + c.k * 17 + c.T));
  const Options o = options_of(c, rng);
  HostTensor logits(DType::kF32, {c.T, c.E});
  std::normal_distribution<float> normal(0.f, 2.f);
  for (int64_t i = 0; i < c.T * c.E; ++i) logits.set_flat(i, normal(rng));
  // Cotangents of both weight outputs; the gradient sums them.
  HostTensor d_probs(DType::kF32, {c.T, c.E}), d_w(DType::kF32, {c.T, c.k});
  d_probs.fill_random(rng);
  d_w.fill_random(rng);

  for (RouterImpl impl : kImpls) {
    SCOPED_TRACE(impl_tag(impl));
    const RouteOptions ro = to_route_options(o, impl);
    HostTensor probs(DType::kF32, {c.T, c.E}), map(DType::kBool, {c.T, c.E}),
        idx(DType::kI32, {c.T, c.k}), w(DType::kF32, {c.T, c.k});
    probs.fill(NAN);
    map.fill(7);
    ASSERT_TRUE(route(logits.in(), ro, {probs.mut(), map.mut(), idx.mut(), w.mut()}).ok());
    const int64_t near_ties = expect_route_matches(logits, o, probs, map, idx, w, 2e-6, true);
    EXPECT_LE(near_ties, c.T / 100) << "too many near-tied rows for the check to mean much";

    HostTensor d_logits(DType::kF32, {c.T, c.E});
    d_logits.fill(NAN);
    ASSERT_TRUE(
        route_backward(logits.in(), idx.in(), d_probs.in(), d_w.in(), ro, d_logits.mut()).ok());
    // Finite differences on a few rows: L(x) = <probs, d_probs> + <topk_weights, d_w>, choice
    // held fixed (it is piecewise constant; these logits are far from ties).
    for (int64_t t = 0; t < std::min<int64_t>(c.T, 2); ++t) {
      const Vec x = row_of(logits, t);
      const RowResult base = route_row(x, o);
      const auto loss = [&](const Vec& xp) {
        const Vec wv = weights(xp, choose(x, o), o);  // choice order, not weight order
        const auto chosen = choose(x, o);
        double l = 0;
        for (int32_t i = 0; i < o.k; ++i) {
          const int32_t slot = static_cast<int32_t>(
              std::find(base.idx.begin(), base.idx.end(), chosen[i]) - base.idx.begin());
          l += wv[i] * (d_probs.get({t, chosen[i]}) + d_w.get({t, slot}));
        }
        return l;
      };
      const Vec want = numeric_grad(x, loss);
      for (int64_t e = 0; e < c.E; ++e) {
        ASSERT_NEAR(d_logits.get({t, e}), want[e], 1e-4 * (1 + std::fabs(want[e])))
            << "row " << t << " expert " << e;
      }
    }
    // Every row: not-chosen experts get exactly 0, except with pre-softmax.
    if (!(o.score == RouterScore::kSoftmax && o.pre_softmax)) {
      for (int64_t t = 0; t < c.T; ++t) {
        for (int64_t e = 0; e < c.E; ++e) {
          if (map.get({t, e}) == 0) ASSERT_EQ(d_logits.get({t, e}), 0.0) << t << "," << e;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Router, RouteGrid, testing::ValuesIn(grid()), case_name);

// ---------------------------------------------------------------------------------------------
// Ties, dtypes, layouts, absent outputs.

TEST(Route, TiesGoToTheLowerIndex) {
  // Logits from four well-separated values: many exact ties, in the experts and in the groups.
  const int64_t T = 50, E = 64;
  std::mt19937 rng(3);
  HostTensor logits(DType::kF32, {T, E});
  const float values[] = {-1.0f, 0.0f, 0.5f, 2.0f};
  for (int64_t i = 0; i < T * E; ++i) logits.set_flat(i, values[rng() % 4]);
  std::vector<Options> variants(7);
  for (Options& o : variants) o.k = 8;
  variants[0].score = RouterScore::kSoftmax;
  variants[1].score = RouterScore::kSoftmax;
  variants[1].pre_softmax = true;
  variants[2].score = RouterScore::kSigmoid;
  variants[3].score = RouterScore::kSqrtSoftplus;
  variants[4].score = RouterScore::kSigmoid;
  variants[4].num_groups = 8;
  variants[4].group_topk = 2;
  // Groups of 16 with a top-2 and a top-1 group score: the vector path's one-pass group sums.
  variants[5].score = RouterScore::kSigmoid;
  variants[5].num_groups = 4;
  variants[5].group_topk = 2;
  variants[5].k = 4;
  variants[6].score = RouterScore::kSqrtSoftplus;
  variants[6].num_groups = 4;
  variants[6].group_topk = 2;
  variants[6].k = 2;
  for (const Options& o : variants) {
    const int32_t k = o.k;
    for (RouterImpl impl : kImpls) {
      HostTensor probs(DType::kF32, {T, E}), map(DType::kBool, {T, E}), idx(DType::kI32, {T, k}),
          w(DType::kF32, {T, k});
      ASSERT_TRUE(route(logits.in(), to_route_options(o, impl),
                        {probs.mut(), map.mut(), idx.mut(), w.mut()})
                      .ok());
      expect_route_matches(logits, o, probs, map, idx, w, 1e-6);
    }
  }
}

TEST(Route, BiasChoosesButDoesNotWeight) {
  // A large bias on expert 5 makes it chosen everywhere; its weight is still its own score.
  const int64_t T = 20, E = 16;
  std::mt19937 rng(5);
  HostTensor logits(DType::kF32, {T, E});
  logits.fill_random(rng);
  Options o;
  o.score = RouterScore::kSigmoid;
  o.k = 1;
  o.bias.assign(E, 0.0f);
  o.bias[5] = 10.0f;
  for (RouterImpl impl : kImpls) {
    HostTensor idx(DType::kI32, {T, 1}), w(DType::kF32, {T, 1});
    ASSERT_TRUE(route(logits.in(), to_route_options(o, impl), {{}, {}, idx.mut(), w.mut()}).ok());
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_EQ(idx.get({t, 0}), 5);
      EXPECT_NEAR(w.get({t, 0}), 1.0 / (1.0 + std::exp(-logits.get({t, 5}))), 1e-6);
    }
  }
}

TEST(Route, Bf16LogitsAndOutputsPaddedRowsAndAbsentOutputs) {
  const int64_t T = 37, E = 128;
  const int32_t k = 6;
  std::mt19937 rng(11);
  HostTensor logits(DType::kBF16, {T, E}, /*row_pad=*/5);
  logits.fill_random(rng);
  Options o;
  o.score = RouterScore::kSqrtSoftplus;
  o.k = k;
  o.num_groups = 8;
  o.group_topk = 3;
  o.scale = 2.5;
  for (RouterImpl impl : kImpls) {
    HostTensor probs(DType::kBF16, {T, E}, 3), map(DType::kBool, {T, E}, 9),
        idx(DType::kI32, {T, k}, 1), w(DType::kBF16, {T, k}, 2);
    ASSERT_TRUE(
        route(logits.in(), to_route_options(o, impl), {probs.mut(), map.mut(), idx.mut(), w.mut()})
            .ok());
    // bf16 outputs hold the oracle's weights to bf16 precision.
    expect_route_matches(logits, o, probs, map, idx, w, 8e-3);

    // Only the dense form: the same indices.
    HostTensor idx2(DType::kI32, {T, k}), w2(DType::kF32, {T, k});
    ASSERT_TRUE(route(logits.in(), to_route_options(o, impl), {{}, {}, idx2.mut(), w2.mut()}).ok());
    for (int64_t t = 0; t < T; ++t) {
      for (int32_t i = 0; i < k; ++i) ASSERT_EQ(idx2.get({t, i}), idx.get({t, i}));
    }

    // Backward from d_topk_weights alone, bf16 in, bf16 out, equals the f32 path rounded.
    HostTensor d_w(DType::kBF16, {T, k}), d_logits(DType::kBF16, {T, E}, 4),
        d_logits32(DType::kF32, {T, E});
    d_w.fill_random(rng);
    const RouteOptions ro = to_route_options(o, impl);
    ASSERT_TRUE(route_backward(logits.in(), idx.in(), {}, d_w.in(), ro, d_logits.mut()).ok());
    ASSERT_TRUE(route_backward(logits.in(), idx.in(), {}, d_w.in(), ro, d_logits32.mut()).ok());
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e) {
        ASSERT_EQ(d_logits.get({t, e}), bf16_to_float(float_to_bf16(d_logits32.get({t, e}))));
      }
    }
  }
}

TEST(Route, ImplementationsAgreeOnManyRows) {
  // The threaded path (many rows) against the scalar reference, bit-for-bit in the choice.
  const int64_t T = 3001, E = 256;
  std::mt19937 rng(17);
  HostTensor logits(DType::kF32, {T, E});
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int64_t i = 0; i < T * E; ++i) logits.set_flat(i, normal(rng));
  Options o;
  o.score = RouterScore::kSigmoid;
  o.k = 8;
  o.num_groups = 8;
  o.group_topk = 4;
  o.scale = 2.5;
  o.bias.resize(E);
  for (float& b : o.bias) b = normal(rng) * 0.01f;
  HostTensor idx_v(DType::kI32, {T, 8}), idx_r(DType::kI32, {T, 8}), w_v(DType::kF32, {T, 8}),
      w_r(DType::kF32, {T, 8});
  ASSERT_TRUE(route(logits.in(), to_route_options(o, RouterImpl::kVectorized),
                    {{}, {}, idx_v.mut(), w_v.mut()})
                  .ok());
  ASSERT_TRUE(route(logits.in(), to_route_options(o, RouterImpl::kReference),
                    {{}, {}, idx_r.mut(), w_r.mut()})
                  .ok());
  for (int64_t t = 0; t < T; ++t) {
    for (int32_t i = 0; i < 8; ++i) {
      ASSERT_EQ(idx_v.get({t, i}), idx_r.get({t, i})) << t;
      ASSERT_NEAR(w_v.get({t, i}), w_r.get({t, i}), 1e-6) << t;
    }
  }
}

TEST(Route, LargeOutputsOnUnalignedPaddedRowsMatchTheReference) {
  // Outputs large enough to be written with streaming stores, on padded rows that start at every
  // alignment: the streamed middle and plain ends of each row land exactly, the padding untouched.
  const int64_t T = 16411, E = 256;
  const int32_t k = 8;
  std::mt19937 rng(23);
  HostTensor logits(DType::kF32, {T, E});
  logits.fill_random(rng);
  Options o;
  o.score = RouterScore::kSigmoid;
  o.k = k;
  o.num_groups = 8;
  o.group_topk = 4;
  o.bias.resize(E);
  for (float& b : o.bias) b = static_cast<float>(rng() % 64) / 4096.0f;
  HostTensor d_w(DType::kF32, {T, k});
  d_w.fill_random(rng);
  struct Out {
    HostTensor probs{DType::kF32, {T, E}, 3}, map{DType::kBool, {T, E}, 5},
        idx{DType::kI32, {T, k}}, d_logits{DType::kF32, {T, E}, 7};
  };
  Out got, want;
  got.probs.fill(-7.0f);
  got.map.fill(3.0f);
  got.d_logits.fill(-7.0f);
  const RouteOptions vec = to_route_options(o, RouterImpl::kVectorized);
  const RouteOptions ref = to_route_options(o, RouterImpl::kReference);
  ASSERT_TRUE(route(logits.in(), vec, {got.probs.mut(), got.map.mut(), got.idx.mut(), {}}).ok());
  ASSERT_TRUE(route(logits.in(), ref, {want.probs.mut(), want.map.mut(), want.idx.mut(), {}}).ok());
  ASSERT_TRUE(
      route_backward(logits.in(), got.idx.in(), {}, d_w.in(), vec, got.d_logits.mut()).ok());
  ASSERT_TRUE(
      route_backward(logits.in(), got.idx.in(), {}, d_w.in(), ref, want.d_logits.mut()).ok());
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      ASSERT_EQ(got.map.get({t, e}), want.map.get({t, e})) << t << "," << e;
      ASSERT_NEAR(got.probs.get({t, e}), want.probs.get({t, e}), 1e-6) << t << "," << e;
      ASSERT_NEAR(got.d_logits.get({t, e}), want.d_logits.get({t, e}), 1e-5) << t << "," << e;
    }
    for (int64_t e = E; e < E + 3; ++e) ASSERT_EQ(got.probs.get({t, e}), -7.0f);
    for (int64_t e = E; e < E + 5; ++e) ASSERT_EQ(got.map.get({t, e}), 3.0);
    for (int64_t e = E; e < E + 7; ++e) ASSERT_EQ(got.d_logits.get({t, e}), -7.0f);
  }
}

TEST(Route, TokenLaneBlocksWithHardRowsMatchTheReference) {
  // The vectorised forward routes blocks of 16 rows with the tokens in vector lanes, comparing
  // keys with the expert index packed into their low bits, and hands the rows it cannot decide
  // that way to the row kernels. Every block here mixes ordinary rows with such rows (a NaN, an
  // infinity, an exact tie at the k-th place, two keys there one step apart, which the packed
  // compare cannot tell apart) and rows past the last whole block; k reaches 16, and group
  // scores sum up to 8 keys. Rows without NaN must match the reference exactly in the choice.
  struct Config {
    RouterScore score;
    bool pre_softmax;
    int64_t E;
    int32_t k, num_groups, group_topk;
    bool bias;
    DType dtype;
  };
  const Config configs[] = {
      {RouterScore::kSoftmax, false, 128, 8, 0, 0, false, DType::kF32},
      {RouterScore::kSoftmax, false, 128, 8, 0, 0, false, DType::kBF16},
      {RouterScore::kSoftmax, true, 64, 6, 0, 0, false, DType::kF32},
      {RouterScore::kSigmoid, false, 256, 8, 8, 4, true, DType::kF32},
      {RouterScore::kSigmoid, false, 96, 16, 4, 2, true, DType::kF32},
      {RouterScore::kSigmoid, false, 64, 3, 8, 1, false, DType::kBF16},
      {RouterScore::kSqrtSoftplus, false, 40, 12, 0, 0, false, DType::kBF16},
      {RouterScore::kSoftmax, false, 20, 2, 0, 0, false, DType::kF32},
  };
  const int64_t T = 16 * 6 + 5;
  std::mt19937 rng(37);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (const Config& c : configs) {
    SCOPED_TRACE(fmt::format("score={} pre={} E={} k={} groups={} dtype={}",
                             static_cast<int>(c.score), c.pre_softmax, c.E, c.k, c.num_groups,
                             dtype_name(c.dtype)));
    Options o = make_options(c.score, c.pre_softmax, c.k, c.num_groups, c.group_topk, 1.5);
    if (c.bias) {
      o.bias.resize(c.E);
      for (float& b : o.bias) b = normal(rng) * 0.01f;
    }
    HostTensor logits(c.dtype, {T, c.E});
    std::vector<bool> has_nan(T, false);
    const bool bf16 = c.dtype == DType::kBF16;
    for (int64_t t = 0; t < T; ++t) {
      std::vector<float> x(c.E);
      for (float& v : x) v = bf16 ? bf16_to_float(float_to_bf16(normal(rng))) : normal(rng);
      // The ranks of the row's logits, largest first: rank k - 1 is the last chosen (without
      // bias or groups), rank k the first left out.
      std::vector<int32_t> order(c.E);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return x[a] > x[b]; });
      const int32_t kth = order[c.k - 1], next = order[c.k];
      const int32_t any = static_cast<int32_t>(rng() % c.E);
      switch (t % 8) {
        case 1:  // NaN
          x[any] = NAN;
          has_nan[t] = true;
          break;
        case 2:  // an infinity: +inf saturates the sigmoid, -inf is any score's lowest
          x[any] = c.score == RouterScore::kSigmoid ? HUGE_VALF : -HUGE_VALF;
          break;
        case 3:  // an exact tie at the k-th place
          x[next] = x[kth];
          break;
        case 4: {  // one step apart there: the higher index moved a step off the lower
          const float v = x[std::min(kth, next)];
          x[std::max(kth, next)] =
              bf16 ? bf16_to_float(float_to_bf16(v) + 1) : std::nextafter(v, HUGE_VALF);
          break;
        }
        default:
          break;
      }
      for (int64_t e = 0; e < c.E; ++e) logits.set({t, e}, x[e]);
    }
    struct Out {
      Out(int64_t T, const Config& c)
          : probs(DType::kF32, {T, c.E}),
            map(DType::kBool, {T, c.E}),
            idx(DType::kI32, {T, c.k}),
            w(DType::kF32, {T, c.k}) {}
      HostTensor probs, map, idx, w;
    };
    Out got(T, c), want(T, c);
    for (auto [impl, out] :
         {std::pair{RouterImpl::kVectorized, &got}, std::pair{RouterImpl::kReference, &want}}) {
      ASSERT_TRUE(route(logits.in(), to_route_options(o, impl),
                        {out->probs.mut(), out->map.mut(), out->idx.mut(), out->w.mut()})
                      .ok());
    }
    for (int64_t t = 0; t < T; ++t) {
      SCOPED_TRACE(fmt::format("row {} (kind {})", t, t % 8));
      std::vector<bool> seen(c.E, false);
      for (int32_t i = 0; i < c.k; ++i) {
        const double e = got.idx.get({t, i});
        ASSERT_GE(e, 0);
        ASSERT_LT(e, c.E);
        ASSERT_FALSE(seen[static_cast<size_t>(e)]);
        seen[static_cast<size_t>(e)] = true;
      }
      for (int64_t e = 0; e < c.E; ++e) ASSERT_EQ(got.map.get({t, e}), seen[e] ? 1.0 : 0.0);
      if (has_nan[t]) continue;  // no order to match: valid and self-consistent is all
      // The output order: descending weight, ties to the lower expert.
      for (int32_t i = 1; i < c.k; ++i) {
        const double w0 = got.w.get({t, i - 1}), w1 = got.w.get({t, i});
        ASSERT_TRUE(w0 > w1 || (w0 == w1 && got.idx.get({t, i - 1}) < got.idx.get({t, i})))
            << "slot " << i;
      }
      // Two scores one step apart may round to equal weights in one implementation of the
      // activation and not in the other: there the order may differ, but not the choice (probs).
      const bool near_tie = t % 8 == 4 && c.score != RouterScore::kSoftmax;
      for (int32_t i = 0; i < c.k && !near_tie; ++i) {
        ASSERT_EQ(got.idx.get({t, i}), want.idx.get({t, i})) << "slot " << i;
        const double w = want.w.get({t, i});
        ASSERT_NEAR(got.w.get({t, i}), w, 1e-6 * (1 + std::fabs(w))) << "slot " << i;
      }
      for (int64_t e = 0; e < c.E; ++e) {
        const double p = want.probs.get({t, e});
        ASSERT_NEAR(got.probs.get({t, e}), p, 1e-6 * (1 + std::fabs(p))) << "expert " << e;
      }
    }
  }
}

// The vectorised forward and backward on every Highway target this CPU runs (AVX-512, AVX2,
// SSE4, ...) against the scalar reference: expert counts that leave a vector tail, groups that
// are no whole number of vectors, f32 and bf16 outputs, and outputs large enough to be streamed,
// on aligned rows and on padded rows that start at every alignment.
TEST(Route, EveryVectorTargetMatchesTheReference) {
  struct Config {
    RouterScore score;
    bool pre_softmax;
    int64_t E;
    int32_t k, num_groups, group_topk;
    DType out_type;
  };
  const Config configs[] = {
      {RouterScore::kSoftmax, false, 99, 7, 0, 0, DType::kF32},
      {RouterScore::kSoftmax, true, 99, 6, 0, 0, DType::kBF16},
      {RouterScore::kSigmoid, false, 96, 8, 8, 4, DType::kF32},
      {RouterScore::kSqrtSoftplus, false, 100, 5, 0, 0, DType::kBF16},
  };
  const auto targets = hwy::SupportedAndGeneratedTargets();
  ASSERT_GE(targets.size(), 2u);  // at least one vector target beside the baseline
  std::mt19937 rng(29);
  for (const Config& c : configs) {
    // Outputs in the logits dtype; enough rows that probs and d_logits pass the 4 MiB streaming
    // threshold.
    const int64_t T = (4 << 20) / (c.E * static_cast<int64_t>(dtype_size(c.out_type))) + 7;
    Options o = make_options(c.score, c.pre_softmax, c.k, c.num_groups, c.group_topk, 1.5);
    if (c.score == RouterScore::kSigmoid) {
      o.bias.resize(c.E);
      for (float& b : o.bias) b = static_cast<float>(rng() % 64) / 4096.0f;
    }
    HostTensor logits(c.out_type, {T, c.E}), d_probs(DType::kF32, {T, c.E}),
        d_w(DType::kF32, {T, c.k});
    logits.fill_random(rng);
    d_probs.fill_random(rng);
    d_w.fill_random(rng);
    for (const int64_t pad : {0, 3}) {
      SCOPED_TRACE(fmt::format("E={} k={} pad={}", c.E, c.k, pad));
      struct Out {
        Out(int64_t T, const Config& c, int64_t pad)
            : probs(c.out_type, {T, c.E}, pad),
              map(DType::kBool, {T, c.E}, pad),
              idx(DType::kI32, {T, c.k}),
              w(c.out_type, {T, c.k}),
              d_logits(c.out_type, {T, c.E}, pad) {}
        HostTensor probs, map, idx, w, d_logits;
      };
      auto run = [&](RouterImpl impl, Out& out) {
        const RouteOptions ro = to_route_options(o, impl);
        ASSERT_TRUE(
            route(logits.in(), ro, {out.probs.mut(), out.map.mut(), out.idx.mut(), out.w.mut()})
                .ok());
        ASSERT_TRUE(route_backward(logits.in(), out.idx.in(), d_probs.in(), d_w.in(), ro,
                                   out.d_logits.mut())
                        .ok());
      };
      Out want(T, c, pad);
      run(RouterImpl::kReference, want);
      // Output values differ from the reference's by f32 rounding only; a bf16 output by at
      // most one bf16 step where those differences round apart.
      const double rel = c.out_type == DType::kBF16 ? 0x1p-7 : 1e-5;
      for (const int64_t target : targets) {
        SCOPED_TRACE(hwy::TargetName(target));
        hwy::SetSupportedTargetsForTest(target);
        Out got(T, c, pad);
        got.probs.fill(-7.0f);
        got.map.fill(3.0f);
        got.d_logits.fill(-7.0f);
        run(RouterImpl::kVectorized, got);
        for (int64_t t = 0; t < T; ++t) {
          for (int32_t i = 0; i < c.k; ++i) {
            ASSERT_EQ(got.idx.get({t, i}), want.idx.get({t, i})) << t;
            ASSERT_NEAR(got.w.get({t, i}), want.w.get({t, i}), rel * std::fabs(want.w.get({t, i})))
                << t;
          }
          for (int64_t e = 0; e < c.E + pad; ++e) {
            ASSERT_EQ(got.map.get({t, e}), e < c.E ? want.map.get({t, e}) : 3.0) << t << "," << e;
            const double p = want.probs.get({t, e}), d = want.d_logits.get({t, e});
            if (e >= c.E) {
              ASSERT_EQ(got.probs.get({t, e}), -7.0f) << t << "," << e;
              ASSERT_EQ(got.d_logits.get({t, e}), -7.0f) << t << "," << e;
              continue;
            }
            ASSERT_NEAR(got.probs.get({t, e}), p, rel * std::fabs(p)) << t << "," << e;
            ASSERT_NEAR(got.d_logits.get({t, e}), d, rel * std::fabs(d) + 1e-6) << t << "," << e;
          }
        }
      }
      hwy::SetSupportedTargetsForTest(0);  // back to what the CPU supports
    }
  }
}

TEST(Route, ZeroTokensWritesNothingAndSucceeds) {
  HostTensor logits(DType::kF32, {0, 8}), idx(DType::kI32, {0, 2});
  RouteOptions o;
  o.k = 2;
  EXPECT_TRUE(route(logits.in(), o, {{}, {}, idx.mut(), {}}).ok());
  HostTensor d(DType::kF32, {0, 8});
  EXPECT_TRUE(route_backward(logits.in(), idx.in(), {}, {}, o, d.mut()).ok());
}

TEST(Route, NaNLogitsStillGiveKDistinctValidExperts) {
  // NaN has no place in an order; what must hold is memory safety: k distinct experts in
  // [0, E), a routing map with exactly those, and a backward that runs. Rows: all NaN, half NaN,
  // one NaN, none. k = 20 takes the reference's sorts past their small-array path.
  const int64_t T = 4, E = 64;
  std::mt19937 rng(31);
  HostTensor logits(DType::kF32, {T, E});
  logits.fill_random(rng);
  for (int64_t e = 0; e < E; ++e) {
    logits.set({0, e}, NAN);
    if (e % 2) logits.set({1, e}, NAN);
  }
  logits.set({2, 17}, NAN);
  for (int32_t k : {2, 8, 20}) {
    std::vector<Options> variants(4);
    variants[1].pre_softmax = true;
    variants[2].score = RouterScore::kSigmoid;
    variants[2].bias.assign(E, 0.01f);
    variants[2].num_groups = 4;
    variants[2].group_topk = 2;
    variants[3].score = RouterScore::kSqrtSoftplus;
    for (Options& o : variants) {
      o.k = k;
      if (o.num_groups > 0 && k % o.group_topk != 0) continue;
      for (RouterImpl impl : kImpls) {
        SCOPED_TRACE(
            fmt::format("k={} score={} impl={}", k, static_cast<int>(o.score), impl_tag(impl)));
        HostTensor map(DType::kBool, {T, E}), idx(DType::kI32, {T, k}), w(DType::kF32, {T, k});
        const RouteOptions ro = to_route_options(o, impl);
        ASSERT_TRUE(route(logits.in(), ro, {{}, map.mut(), idx.mut(), w.mut()}).ok());
        for (int64_t t = 0; t < T; ++t) {
          std::vector<bool> seen(E, false);
          for (int32_t i = 0; i < k; ++i) {
            const double e = idx.get({t, i});
            ASSERT_GE(e, 0);
            ASSERT_LT(e, E);
            ASSERT_FALSE(seen[static_cast<size_t>(e)]) << "expert " << e << " twice in row " << t;
            seen[static_cast<size_t>(e)] = true;
          }
          for (int64_t e = 0; e < E; ++e) ASSERT_EQ(map.get({t, e}), seen[e] ? 1 : 0);
        }
        HostTensor d(DType::kF32, {T, E});
        ASSERT_TRUE(route_backward(logits.in(), idx.in(), {}, w.in(), ro, d.mut()).ok());
      }
    }
  }
}

// Rows with NaN (and infinities) in every pattern a blow-up gives: one NaN, a few, half, all,
// NaN beside -inf and +inf. 40 rows, E = 64, for the NaN rule's tests.
HostTensor nan_rows(DType dtype) {
  const int64_t T = 40, E = 64;
  std::mt19937 rng(5);
  HostTensor logits(dtype, {T, E});
  logits.fill_random(rng);
  std::uniform_int_distribution<int64_t> col(0, E - 1);
  for (int64_t t = 0; t < T; ++t) {
    const int pattern = static_cast<int>(t % 8);
    const int64_t nans = pattern == 0   ? 0
                         : pattern == 1 ? 1
                         : pattern == 2 ? 3
                         : pattern == 3 ? E / 2
                         : pattern == 4 ? E
                                        : 2;
    for (int64_t i = 0; i < nans; ++i) logits.set({t, pattern == 4 ? i : col(rng)}, NAN);
    if (pattern == 5) logits.set({t, col(rng)}, -INFINITY);
    if (pattern == 6) logits.set({t, col(rng)}, INFINITY);
    if (pattern == 7) {
      for (int64_t e = 0; e < E; ++e) logits.set({t, e}, e % 3 ? -INFINITY : NAN);
    }
  }
  return logits;
}

TEST(Route, NaNLogitsFollowOneRuleInEveryImplementation) {
  // router.h's rule for NaN logits: a NaN selection score ranks below every number, -inf
  // included, NaNs among themselves by index (a group whose score sums a NaN likewise); the
  // weights follow the formulas, NaN wherever they take a NaN (softmax pre: the whole row), and
  // the output order by weight puts NaN weights last. Both implementations give the oracle's
  // experts, and weights NaN in the same places.
  const int64_t E = 64;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    HostTensor logits = nan_rows(dtype);
    const int64_t T = logits.shape[0];
    for (int32_t k : {1, 2, 8}) {
      std::vector<Options> variants(5);
      variants[1].pre_softmax = true;
      variants[2].score = RouterScore::kSigmoid;
      variants[3].score = RouterScore::kSqrtSoftplus;
      variants[3].bias.assign(E, 0.01f);
      variants[4].score = RouterScore::kSigmoid;
      variants[4].num_groups = 8;
      variants[4].group_topk = k == 1 ? 1 : 2;
      for (size_t v = 0; v < variants.size(); ++v) {
        Options& o = variants[v];
        o.k = k;
        for (RouterImpl impl : kImpls) {
          HostTensor idx(DType::kI32, {T, k}), w(DType::kF32, {T, k});
          ASSERT_TRUE(
              route(logits.in(), to_route_options(o, impl), {{}, {}, idx.mut(), w.mut()}).ok());
          for (int64_t t = 0; t < T; ++t) {
            const RowResult want = route_row(row_of(logits, t), o);
            for (int32_t i = 0; i < k; ++i) {
              SCOPED_TRACE(fmt::format("{} {} k={} variant {} row {} slot {}", dtype_name(dtype),
                                       impl_tag(impl), k, v, t, i));
              EXPECT_EQ(idx.get({t, i}), want.idx[i]);
              const double got = w.get({t, i});
              EXPECT_EQ(std::isnan(got), std::isnan(want.w[i])) << got << " " << want.w[i];
              if (!std::isnan(want.w[i]) && got != want.w[i]) EXPECT_NEAR(got, want.w[i], 2e-6);
            }
          }
          // The backward follows the formulas too: NaN where the reference's is (softmax pre:
          // a row with a NaN has NaN probabilities, so its whole gradient), even under a zero
          // cotangent (0 * NaN), and the reference's values elsewhere.
          HostTensor d_w(DType::kF32, {T, k}), d(DType::kF32, {T, E}), want_d(DType::kF32, {T, E});
          for (int64_t i = 0; i < T * k; ++i) d_w.set_flat(i, i % 3 == 0 ? 0.0 : 0.25 * (i % 5));
          ASSERT_TRUE(route_backward(logits.in(), idx.in(), {}, d_w.in(), to_route_options(o, impl),
                                     d.mut())
                          .ok());
          ASSERT_TRUE(route_backward(logits.in(), idx.in(), {}, d_w.in(),
                                     to_route_options(o, RouterImpl::kReference), want_d.mut())
                          .ok());
          for (int64_t i = 0; i < T * E; ++i) {
            const double got = d.get_flat(i), want = want_d.get_flat(i);
            ASSERT_EQ(std::isnan(got), std::isnan(want))
                << fmt::format("{} {} k={} variant {} d_logits[{}, {}]: {} against {}",
                               dtype_name(dtype), impl_tag(impl), k, v, i / E, i % E, got, want);
            if (!std::isnan(want)) ASSERT_NEAR(got, want, 1e-5 * (1 + std::fabs(want)));
          }
        }
      }
    }
  }
}

TEST(Route, BackwardSumsTheGradientsOfRepeatedIndices) {
  // topk_indices come from the caller and may name an expert twice in a row: both slots'
  // gradients land on it, summed, in every implementation (rows in and past whole lane blocks).
  // Every input has padded rows, so that a block's rows are read by their own strides.
  const int64_t T = 37, E = 24;
  const int32_t k = 4;
  std::mt19937 rng(41);
  HostTensor logits(DType::kF32, {T, E}, 1), idx(DType::kI32, {T, k}, 3),
      d_w(DType::kF32, {T, k}, 2), d_probs(DType::kF32, {T, E}, 5);
  logits.fill_random(rng);
  d_w.fill_random(rng);
  d_probs.fill_random(rng);
  for (int64_t t = 0; t < T; ++t) {
    for (int32_t i = 0; i < k; ++i) idx.set({t, i}, static_cast<double>(rng() % E));
    idx.set({t, k - 1}, idx.get({t, 0}));  // a repeat in every row
  }
  for (const RouterScore score :
       {RouterScore::kSoftmax, RouterScore::kSigmoid, RouterScore::kSqrtSoftplus}) {
    for (const bool pre : {false, true}) {
      if (pre && score != RouterScore::kSoftmax) continue;
      SCOPED_TRACE(fmt::format("score={} pre={}", static_cast<int>(score), pre));
      Options o;
      o.score = score;
      o.pre_softmax = pre;
      o.k = k;
      o.scale = 0.5;
      HostTensor got(DType::kF32, {T, E}), want(DType::kF32, {T, E});
      ASSERT_TRUE(route_backward(logits.in(), idx.in(), d_probs.in(), d_w.in(),
                                 to_route_options(o, RouterImpl::kVectorized), got.mut())
                      .ok());
      ASSERT_TRUE(route_backward(logits.in(), idx.in(), d_probs.in(), d_w.in(),
                                 to_route_options(o, RouterImpl::kReference), want.mut())
                      .ok());
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t e = 0; e < E; ++e) {
          const double w = want.get({t, e});
          ASSERT_NEAR(got.get({t, e}), w, 1e-5 * (1 + std::fabs(w))) << t << "," << e;
        }
      }
    }
  }
}

TEST(Route, Bf16BackwardEqualsF32BackwardOnTheSameValues) {
  // The backward reads bf16 logits through its own path (only the chosen are converted); on
  // bf16-exact values it must give exactly what the oracle-checked f32 path gives.
  const int64_t T = 40, E = 128;
  const int32_t k = 8;
  std::mt19937 rng(37);
  HostTensor lb(DType::kBF16, {T, E}), lf(DType::kF32, {T, E}), d_w(DType::kF32, {T, k});
  lb.fill_random(rng);
  d_w.fill_random(rng);
  for (int64_t i = 0; i < T * E; ++i) lf.set_flat(i, lb.get_flat(i));
  std::vector<Options> variants(4);
  variants[1].pre_softmax = true;
  variants[2].score = RouterScore::kSigmoid;
  variants[3].score = RouterScore::kSqrtSoftplus;
  for (Options& o : variants) {
    o.k = k;
    o.scale = 2.5;
    for (RouterImpl impl : kImpls) {
      const RouteOptions ro = to_route_options(o, impl);
      HostTensor idx(DType::kI32, {T, k}), d_b(DType::kF32, {T, E}), d_f(DType::kF32, {T, E});
      ASSERT_TRUE(route(lf.in(), ro, {{}, {}, idx.mut(), {}}).ok());
      ASSERT_TRUE(route_backward(lb.in(), idx.in(), {}, d_w.in(), ro, d_b.mut()).ok());
      ASSERT_TRUE(route_backward(lf.in(), idx.in(), {}, d_w.in(), ro, d_f.mut()).ok());
      for (int64_t i = 0; i < T * E; ++i) ASSERT_EQ(d_b.get_flat(i), d_f.get_flat(i)) << i;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Aux-loss scores.

class AuxScores : public testing::TestWithParam<std::tuple<RouterScore, int64_t, int32_t>> {};

TEST_P(AuxScores, MatchOracleAndFiniteDifferences) {
  const auto [score, E, k] = GetParam();
  const int64_t T = 57;
  std::mt19937 rng(static_cast<uint32_t>(E + k));
  HostTensor logits(DType::kF32, {T, E}), d_scores(DType::kF32, {T, E});
  std::normal_distribution<float> normal(0.f, 2.f);
  for (int64_t i = 0; i < T * E; ++i) logits.set_flat(i, normal(rng));
  d_scores.fill_random(rng);
  for (RouterImpl impl : kImpls) {
    SCOPED_TRACE(impl_tag(impl));
    HostTensor scores(DType::kF32, {T, E}), map(DType::kBool, {T, E}),
        d_logits(DType::kF32, {T, E});
    ASSERT_TRUE(aux_loss_scores(logits.in(), k, score, scores.mut(), map.mut(), impl).ok());
    ASSERT_TRUE(
        aux_loss_scores_backward(logits.in(), d_scores.in(), score, d_logits.mut(), impl).ok());
    for (int64_t t = 0; t < T; ++t) {
      const Vec x = row_of(logits, t);
      const Vec q = aux_scores_row(x, score);
      std::vector<int32_t> top = ranked(q, std::vector<bool>(E, true));
      top.resize(k);
      for (int64_t e = 0; e < E; ++e) {
        ASSERT_NEAR(scores.get({t, e}), q[e], 1e-6 * (1 + q[e])) << t << "," << e;
        const bool chosen = std::find(top.begin(), top.end(), e) != top.end();
        ASSERT_EQ(map.get({t, e}), chosen ? 1 : 0) << t << "," << e;
      }
      if (t < 3) {
        const Vec dq = row_of(d_scores, t);
        const Vec want = numeric_grad(x, [&](const Vec& xp) {
          const Vec qp = aux_scores_row(xp, score);
          return std::inner_product(qp.begin(), qp.end(), dq.begin(), 0.0);
        });
        for (int64_t e = 0; e < E; ++e) {
          ASSERT_NEAR(d_logits.get({t, e}), want[e], 1e-5 * (1 + std::fabs(want[e]))) << t;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Router, AuxScores,
                         testing::Combine(testing::Values(RouterScore::kSoftmax,
                                                          RouterScore::kSigmoid,
                                                          RouterScore::kSqrtSoftplus),
                                          testing::Values<int64_t>(8, 64, 256),
                                          testing::Values<int32_t>(1, 8)));

// ---------------------------------------------------------------------------------------------
// Losses and the bias update.

TEST(Losses, CountTokensPerExpertPerBatchAndPerSequence) {
  const int64_t T = 12, E = 5;
  HostTensor map(DType::kBool, {T, E});
  std::mt19937 rng(1);
  for (int64_t i = 0; i < T * E; ++i) map.set_flat(i, rng() % 2);
  HostTensor all(DType::kI32, {E}), per_seq(DType::kI32, {3, E});
  ASSERT_TRUE(count_tokens_per_expert(map.in(), all.mut()).ok());
  ASSERT_TRUE(count_tokens_per_expert(map.in(), per_seq.mut()).ok());
  for (int64_t e = 0; e < E; ++e) {
    double total = 0;
    for (int64_t b = 0; b < 3; ++b) {
      double n = 0;
      for (int64_t t = b * 4; t < (b + 1) * 4; ++t) n += map.get({t, e});
      EXPECT_EQ(per_seq.get({b, e}), n);
      total += n;
    }
    EXPECT_EQ(all.get({e}), total);
  }
}

TEST(Losses, LoadBalancingLossAndGradient) {
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const int64_t T = 1000, E = 64;
    const int32_t k = 6;
    std::mt19937 rng(23);
    HostTensor scores(dt, {T, E}), tpe(DType::kI32, {E});
    scores.fill_random(rng);
    for (int64_t e = 0; e < E; ++e) tpe.set({e}, rng() % 300);
    for (int64_t total : {int64_t{0}, int64_t{4000}}) {
      LoadBalancingOptions o{k, 0.01f, total};
      const double T_total = total == 0 ? T : total;
      const double c = E * 0.01 / (k * T_total * T_total);
      double want = 0;
      for (int64_t e = 0; e < E; ++e) {
        double col = 0;
        for (int64_t t = 0; t < T; ++t) col += scores.get({t, e});
        want += col * tpe.get({e});
      }
      want *= c;
      float loss = NAN;
      ASSERT_TRUE(load_balancing_loss(scores.in(), tpe.in(), o, &loss).ok());
      EXPECT_NEAR(loss, want, 1e-5 * std::fabs(want));
      HostTensor d(dt, {T, E});
      ASSERT_TRUE(load_balancing_loss_backward(tpe.in(), o, 3.0f, d.mut()).ok());
      for (int64_t t = 0; t < T; t += 97) {
        for (int64_t e = 0; e < E; ++e) {
          const double g = c * tpe.get({e}) * 3.0;
          ASSERT_NEAR(d.get({t, e}), g, (dt == DType::kF32 ? 1e-6 : 8e-3) * g) << t << "," << e;
        }
      }
    }
  }
}

TEST(Losses, SequenceLoadBalancingLossIsTheMeanOverSequences) {
  const int64_t B = 4, S = 25, T = B * S, E = 16;
  const int32_t k = 2;
  std::mt19937 rng(29);
  HostTensor scores(DType::kF32, {T, E}), tpe(DType::kI32, {B, E});
  scores.fill_random(rng);
  for (int64_t i = 0; i < B * E; ++i) tpe.set_flat(i, rng() % 10);
  const LoadBalancingOptions o{k, 0.5f, 0};
  double want = 0;
  for (int64_t b = 0; b < B; ++b) {
    // The batch loss of sequence b alone.
    HostTensor one(DType::kF32, {S, E}), counts(DType::kI32, {E});
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t e = 0; e < E; ++e) one.set({s, e}, scores.get({b * S + s, e}));
    }
    for (int64_t e = 0; e < E; ++e) counts.set({e}, tpe.get({b, e}));
    float l = NAN;
    ASSERT_TRUE(load_balancing_loss(one.in(), counts.in(), o, &l).ok());
    want += l / B;
  }
  float loss = NAN;
  ASSERT_TRUE(seq_load_balancing_loss(scores.in(), tpe.in(), o, &loss).ok());
  EXPECT_NEAR(loss, want, 1e-6 * std::fabs(want));
  HostTensor d(DType::kF32, {T, E});
  ASSERT_TRUE(seq_load_balancing_loss_backward(tpe.in(), o, 2.0f, d.mut()).ok());
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      const double g = E * 0.5 / (k * S * S) * tpe.get({t / S, e}) * 2.0 / B;
      ASSERT_NEAR(d.get({t, e}), g, 1e-6 * g);
    }
  }
}

TEST(Losses, ZLossAndGradient) {
  for (int64_t E : {1, 7, 256}) {
    const int64_t T = 300;
    std::mt19937 rng(static_cast<uint32_t>(E));
    HostTensor logits(DType::kF32, {T, E}), d(DType::kF32, {T, E});
    std::normal_distribution<float> normal(0.f, 3.f);
    for (int64_t i = 0; i < T * E; ++i) logits.set_flat(i, normal(rng));
    const auto zloss = [&](const std::vector<Vec>& rows) {
      double s = 0;
      for (const Vec& x : rows) {
        const double m = *std::max_element(x.begin(), x.end());
        double sum = 0;
        for (double v : x) sum += std::exp(v - m);
        s += std::pow(m + std::log(sum), 2);
      }
      return 0.001 * s / T;
    };
    std::vector<Vec> rows;
    for (int64_t t = 0; t < T; ++t) rows.push_back(row_of(logits, t));
    float loss = NAN;
    ASSERT_TRUE(z_loss(logits.in(), 0.001f, &loss).ok());
    EXPECT_NEAR(loss, zloss(rows), 1e-5 * zloss(rows));
    ASSERT_TRUE(z_loss_backward(logits.in(), 0.001f, 1.5f, d.mut()).ok());
    for (int64_t t = 0; t < 3; ++t) {
      const Vec want = numeric_grad(rows[t], [&](const Vec& xp) {
        std::vector<Vec> r = rows;
        r[t] = xp;
        return 1.5 * zloss(r);
      });
      for (int64_t e = 0; e < E; ++e)
        ASSERT_NEAR(d.get({t, e}), want[e], 1e-7 + 1e-4 * std::fabs(want[e]));
    }
  }
}

TEST(Losses, NaNLogitsGiveNaNScoresLossesAndGradients) {
  // A blow-up must show in the losses, not vanish: a row holding a NaN has NaN aux scores (each
  // score's normaliser takes the NaN) and NaN gradients in both implementations, as the
  // reference's formulas give, and the z-loss of logits holding a NaN is NaN, with NaN gradient
  // in those rows only. The routing map's choice follows router.h's NaN rule (tested above).
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    HostTensor logits = nan_rows(dtype);
    const int64_t T = logits.shape[0], E = logits.shape[1];
    std::vector<bool> nan_row(T, false);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e) nan_row[t] = nan_row[t] || std::isnan(logits.get({t, e}));
    }
    HostTensor d_scores(DType::kF32, {T, E});
    d_scores.fill(0.5f);
    for (RouterScore score :
         {RouterScore::kSoftmax, RouterScore::kSigmoid, RouterScore::kSqrtSoftplus}) {
      for (RouterImpl impl : kImpls) {
        SCOPED_TRACE(fmt::format("{} score {} {}", dtype_name(dtype), static_cast<int>(score),
                                 impl_tag(impl)));
        HostTensor scores(DType::kF32, {T, E}), map(DType::kBool, {T, E}), d(DType::kF32, {T, E});
        ASSERT_TRUE(aux_loss_scores(logits.in(), 2, score, scores.mut(), map.mut(), impl).ok());
        ASSERT_TRUE(
            aux_loss_scores_backward(logits.in(), d_scores.in(), score, d.mut(), impl).ok());
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t e = 0; e < E; ++e) {
            ASSERT_EQ(std::isnan(scores.get({t, e})), nan_row[t]) << "scores " << t << "," << e;
            ASSERT_EQ(std::isnan(d.get({t, e})), nan_row[t]) << "d_logits " << t << "," << e;
          }
        }
      }
    }
    float loss = 0.0f;
    ASSERT_TRUE(z_loss(logits.in(), 0.001f, &loss).ok());
    EXPECT_TRUE(std::isnan(loss)) << loss;
    HostTensor d(DType::kF32, {T, E});
    ASSERT_TRUE(z_loss_backward(logits.in(), 0.001f, 1.0f, d.mut()).ok());
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e) {
        ASSERT_EQ(std::isnan(d.get({t, e})), nan_row[t]) << "z-loss d_logits " << t << "," << e;
      }
    }
  }
}

TEST(Losses, ZeroLocalTokens) {
  // A shard with no tokens: its loss contributions are 0, its counts are 0, nothing fails.
  const int64_t E = 8;
  HostTensor logits(DType::kF32, {0, E}), map(DType::kBool, {0, E}), counts(DType::kI32, {E}),
      scores(DType::kF32, {0, E}), tpe(DType::kI32, {E});
  counts.fill(5);
  tpe.fill(3);
  ASSERT_TRUE(count_tokens_per_expert(map.in(), counts.mut()).ok());
  for (int64_t e = 0; e < E; ++e) EXPECT_EQ(counts.get({e}), 0);
  ASSERT_TRUE(aux_loss_scores(logits.in(), 2, RouterScore::kSigmoid, scores.mut(), map.mut()).ok());
  float loss = NAN;
  ASSERT_TRUE(load_balancing_loss(scores.in(), tpe.in(), {2, 1.0f, 100}, &loss).ok());
  EXPECT_EQ(loss, 0.0f);
  loss = NAN;
  ASSERT_TRUE(load_balancing_loss(scores.in(), tpe.in(), {2, 1.0f, 0}, &loss).ok());
  EXPECT_EQ(loss, 0.0f);
  loss = NAN;
  ASSERT_TRUE(z_loss(logits.in(), 1.0f, &loss).ok());
  EXPECT_EQ(loss, 0.0f);
  ASSERT_TRUE(z_loss_backward(logits.in(), 1.0f, 1.0f, scores.mut()).ok());
}

TEST(Losses, ExpertBiasUpdateFollowsTheSignOfTheDeficit) {
  HostTensor tpe(DType::kI32, {4}), bias(DType::kF32, {4});
  const int32_t counts[] = {10, 2, 5, 3};  // mean 5
  for (int64_t e = 0; e < 4; ++e) {
    tpe.set({e}, counts[e]);
    bias.set({e}, 0.5);
  }
  ASSERT_TRUE(update_expert_bias(tpe.in(), 0.1f, bias.mut()).ok());
  EXPECT_FLOAT_EQ(bias.get({0}), 0.4f);  // over-loaded: lowered
  EXPECT_FLOAT_EQ(bias.get({1}), 0.6f);  // under-loaded: raised
  EXPECT_FLOAT_EQ(bias.get({2}), 0.5f);  // at the mean: unchanged
  EXPECT_FLOAT_EQ(bias.get({3}), 0.6f);
}

// ---------------------------------------------------------------------------------------------
// Invalid input: a named error, and nothing written.

struct BadRoute {
  const char* name;
  int32_t k, num_groups, group_topk;
  RouterScore score;
  bool pre;
  int64_t bias_len;
  const char* argument;
};

TEST(RouteErrors, InvalidOptionsAreNamedAndNothingIsWritten) {
  const int64_t T = 3, E = 8;
  const BadRoute cases[] = {
      {"k > E", 9, 0, 0, RouterScore::kSoftmax, false, 0, "k"},
      {"k = 0", 0, 0, 0, RouterScore::kSoftmax, false, 0, "k"},
      {"E % num_groups", 2, 3, 1, RouterScore::kSigmoid, false, 0, "num_groups"},
      {"k % group_topk", 3, 4, 2, RouterScore::kSigmoid, false, 0, "group_topk"},
      {"group_topk > num_groups", 4, 2, 4, RouterScore::kSigmoid, false, 0, "group_topk"},
      {"group_topk without groups", 2, 0, 1, RouterScore::kSigmoid, false, 0, "group_topk"},
      {"k / group_topk > group size", 6, 4, 2, RouterScore::kSigmoid, false, 0, "k"},
      {"bias with softmax", 2, 0, 0, RouterScore::kSoftmax, false, 8, "expert_bias.size()"},
      {"bias of the wrong length", 2, 0, 0, RouterScore::kSigmoid, false, 7, "expert_bias.size()"},
      {"pre_softmax with sigmoid", 2, 0, 0, RouterScore::kSigmoid, true, 0, "pre_softmax"},
  };
  HostTensor logits(DType::kF32, {T, E});
  std::mt19937 rng(1);
  logits.fill_random(rng);
  for (const BadRoute& c : cases) {
    SCOPED_TRACE(c.name);
    Options opt;
    opt.k = c.k;
    opt.num_groups = c.num_groups;
    opt.group_topk = c.group_topk;
    opt.score = c.score;
    opt.pre_softmax = c.pre;
    opt.bias.assign(c.bias_len, 0.0f);
    const RouteOptions o = to_route_options(opt, RouterImpl::kAuto);
    HostTensor probs(DType::kF32, {T, E}), idx(DType::kI32, {T, std::max(c.k, 1)});
    probs.fill(-3.0f);
    idx.fill(-3.0f);
    RouteOutputs out{probs.mut(), {}, {}, {}};
    if (c.k >= 1) out.topk_indices = idx.mut();
    const Status s = route(logits.in(), o, out);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(s.argument(), c.argument) << s.message();
    EXPECT_EQ(s.message().rfind("route: ", 0), 0u) << s.message();
    for (int64_t i = 0; i < T * E; ++i) ASSERT_EQ(probs.get_flat(i), -3.0);
    // The backward validates the same options.
    HostTensor d(DType::kF32, {T, E});
    d.fill(-3.0f);
    const Status sb = route_backward(logits.in(), idx.in(), probs.in(), {}, o, d.mut());
    ASSERT_FALSE(sb.ok());
    EXPECT_EQ(sb.argument(), c.argument) << sb.message();
    for (int64_t i = 0; i < T * E; ++i) ASSERT_EQ(d.get_flat(i), -3.0);
  }
}

TEST(RouteErrors, ShapesDtypesAndIndicesAreNamed) {
  const int64_t T = 4, E = 8;
  HostTensor logits(DType::kF32, {T, E}), i32(DType::kI32, {T, E});
  RouteOptions o;
  o.k = 2;
  const auto expect_arg = [](const Status& s, const std::string& arg) {
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.argument(), arg) << s.message();
  };
  HostTensor probs_bad(DType::kF32, {T, E + 1}), map_f32(DType::kF32, {T, E}),
      idx_f32(DType::kF32, {T, 2}), w_short(DType::kF32, {T, 1}), probs_1d(DType::kF32, {T * E});
  expect_arg(route(i32.in(), o, {}), "logits.dtype");
  expect_arg(route(logits.in(), o, {probs_bad.mut(), {}, {}, {}}), "probs.shape");
  expect_arg(route(logits.in(), o, {probs_1d.mut(), {}, {}, {}}), "probs.rank");
  expect_arg(route(logits.in(), o, {{}, map_f32.mut(), {}, {}}), "routing_map.dtype");
  expect_arg(route(logits.in(), o, {{}, {}, idx_f32.mut(), {}}), "topk_indices.dtype");
  expect_arg(route(logits.in(), o, {{}, {}, {}, w_short.mut()}), "topk_weights.shape");

  HostTensor idx(DType::kI32, {T, 2}), d(DType::kF32, {T, E});
  for (int64_t i = 0; i < T * 2; ++i) idx.set_flat(i, i % E);
  idx.set({2, 1}, E);  // out of range
  d.fill(-3.0f);
  expect_arg(route_backward(logits.in(), idx.in(), {}, {}, o, d.mut()), "topk_indices[2, 1]");
  idx.set({2, 1}, -1);
  expect_arg(route_backward(logits.in(), idx.in(), {}, {}, o, d.mut()), "topk_indices[2, 1]");
  for (int64_t i = 0; i < T * E; ++i) ASSERT_EQ(d.get_flat(i), -3.0);
  idx.set({2, 1}, 0);
  HostTensor d_bad(DType::kI32, {T, E});
  expect_arg(route_backward(logits.in(), idx.in(), {}, {}, o, d_bad.mut()), "d_logits.dtype");
  expect_arg(route_backward(logits.in(), idx.in(), probs_bad.in(), {}, o, d.mut()),
             "d_probs.shape");

  HostTensor scores(DType::kF32, {T, E}), tpe(DType::kI32, {E}), tpe_short(DType::kI32, {E - 1});
  float loss = 0;
  expect_arg(aux_loss_scores(logits.in(), 9, RouterScore::kSoftmax, scores.mut(), {}), "k");
  expect_arg(load_balancing_loss(scores.in(), tpe_short.in(), {}, &loss),
             "tokens_per_expert.shape");
  tpe.set({3}, -1);
  expect_arg(load_balancing_loss(scores.in(), tpe.in(), {}, &loss), "tokens_per_expert[3]");
  tpe.set({3}, 1);
  expect_arg(load_balancing_loss(scores.in(), tpe.in(), {1, 1.0f, T - 1}, &loss), "total_tokens");
  expect_arg(load_balancing_loss(scores.in(), tpe.in(), {}, nullptr), "loss");
  HostTensor tpe3(DType::kI32, {3, E});
  expect_arg(seq_load_balancing_loss(scores.in(), tpe3.in(), {}, &loss),
             "tokens_per_expert.shape[0]");
  HostTensor bias_i32(DType::kI32, {E});
  expect_arg(update_expert_bias(tpe.in(), 0.1f, bias_i32.mut()), "expert_bias.dtype");
  expect_arg(z_loss(logits.in(), NAN, &loss), "coeff");

  HostTensor map(DType::kBool, {T, E}), counts3(DType::kI32, {3, E}),
      counts_r3(DType::kI32, {1, 1, E});
  expect_arg(count_tokens_per_expert(map.in(), counts3.mut()), "counts.shape[0]");  // 3 ∤ T = 4
  expect_arg(count_tokens_per_expert(map.in(), counts_r3.mut()), "counts.rank");
  expect_arg(count_tokens_per_expert(logits.in(), tpe.mut()), "routing_map.dtype");
  HostTensor wide(DType::kF32, {T, E + 1});
  expect_arg(aux_loss_scores_backward(logits.in(), wide.in(), RouterScore::kSoftmax, d.mut()),
             "d_scores.shape");
  expect_arg(z_loss_backward(logits.in(), 1.0f, 1.0f, wide.mut()), "d_logits.shape");
  expect_arg(load_balancing_loss_backward(tpe.in(), {}, NAN, d.mut()), "d_loss");
}

}  // namespace
}  // namespace moekit

// The names the errors give each implementation; "unknown" past the enum.
TEST(Route, ImplNames) {
  EXPECT_STREQ(impl_name(moekit::RouterImpl::kAuto), "auto");
  EXPECT_STREQ(impl_name(moekit::RouterImpl::kCuda), "cuda");
  EXPECT_STREQ(impl_name(moekit::RouterImpl::kVectorized), "vectorized");
  EXPECT_STREQ(impl_name(moekit::RouterImpl::kReference), "reference");
  EXPECT_STREQ(impl_name(static_cast<moekit::RouterImpl>(9)), "unknown");
}
