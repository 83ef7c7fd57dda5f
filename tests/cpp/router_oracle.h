// The router's oracle for the tests: SPEC.md section 2 written out one token row at a time, in
// double precision, with the margins of its decisions (how far a choice is from a tie), and the
// check of route's outputs against it. Used by the CPU tests (test_router.cpp) and the CUDA ones
// (test_router_cuda.cpp).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "host_tensor.h"
#include "moekit/router.h"

namespace moekit::router_oracle {

using Vec = std::vector<double>;

// ---------------------------------------------------------------------------------------------
// The oracle, one token row at a time, in double.

struct Options {
  RouterScore score = RouterScore::kSoftmax;
  bool pre_softmax = false;
  int32_t k = 1, num_groups = 0, group_topk = 0;
  double scale = 1.0;
  std::vector<float> bias;  // empty or [E]
};

inline double act(RouterScore s, double x) {
  if (s == RouterScore::kSigmoid) return 1.0 / (1.0 + std::exp(-x));
  return std::sqrt(std::log1p(std::exp(x)));
}

// The order of every ranking: larger first, NaN after every number (-inf too), NaNs equal.
inline bool ranks_before(double a, double b) { return !std::isnan(a) && (std::isnan(b) || a > b); }

// NaN anywhere gives NaN everywhere (the denominator holds it).
inline Vec softmax(const Vec& x) {
  if (std::any_of(x.begin(), x.end(), [](double v) { return std::isnan(v); })) {
    return Vec(x.size(), NAN);
  }
  const double m = *std::max_element(x.begin(), x.end());
  Vec p(x.size());
  double sum = 0;
  for (size_t i = 0; i < x.size(); ++i) sum += p[i] = std::exp(x[i] - m);
  for (double& v : p) v /= sum;
  return p;
}

// Indices of key sorted by (key descending, NaN last, index ascending), restricted to `allowed`.
inline std::vector<int32_t> ranked(const Vec& key, const std::vector<bool>& allowed) {
  std::vector<int32_t> idx;
  for (int32_t i = 0; i < static_cast<int32_t>(key.size()); ++i) {
    if (allowed[i]) idx.push_back(i);
  }
  std::stable_sort(idx.begin(), idx.end(),
                   [&](int32_t a, int32_t b) { return ranks_before(key[a], key[b]); });
  return idx;
}

struct RowResult {
  std::vector<int32_t> idx;  // chosen, by descending weight
  Vec w;                     // weights
};

// Relative gap between the last value kept and the best value left out of a ranked list; 1 when
// nothing is left out.
inline double gap(const Vec& v, const std::vector<int32_t>& order, size_t kept) {
  if (order.size() <= kept) return 1.0;
  const double a = v[order[kept - 1]], b = v[order[kept]];
  return std::fabs(a - b) / (1.0 + std::fabs(a));
}

// The choice of one row (what is chosen depends only on x, not differentiated). *margin, when
// given, receives the smallest relative gap of the group and expert decisions: below about 1e-6
// f32 arithmetic cannot be expected to decide as double does.
inline std::vector<int32_t> choose(const Vec& x, const Options& o, double* margin = nullptr) {
  double m = 1.0;
  const size_t E = x.size();
  Vec s(E);
  if (o.score == RouterScore::kSoftmax) {
    s = o.pre_softmax ? softmax(x) : x;
  } else {
    for (size_t e = 0; e < E; ++e) s[e] = act(o.score, x[e]) + (o.bias.empty() ? 0 : o.bias[e]);
  }
  std::vector<bool> allowed(E, true);
  if (o.num_groups > 0) {
    const size_t per = E / o.num_groups;
    Vec group_score(o.num_groups, 0.0);
    for (int32_t g = 0; g < o.num_groups; ++g) {
      Vec member(s.begin() + g * per, s.begin() + (g + 1) * per);
      std::stable_sort(member.begin(), member.end(), ranks_before);
      for (int32_t i = 0; i < o.k / o.group_topk; ++i) group_score[g] += member[i];
    }
    const auto best = ranked(group_score, std::vector<bool>(o.num_groups, true));
    m = std::min(m, gap(group_score, best, o.group_topk));
    std::fill(allowed.begin(), allowed.end(), false);
    for (int32_t i = 0; i < o.group_topk; ++i) {
      for (size_t e = best[i] * per; e < (best[i] + 1) * per; ++e) allowed[e] = true;
    }
  }
  auto idx = ranked(s, allowed);
  m = std::min(m, gap(s, idx, o.k));
  if (margin) *margin = m;
  idx.resize(o.k);
  return idx;
}

// The weights of a fixed choice, as a function of x (what the gradient differentiates).
inline Vec weights(const Vec& x, const std::vector<int32_t>& idx, const Options& o) {
  const int32_t k = o.k;
  Vec w(k);
  if (o.score == RouterScore::kSoftmax && o.pre_softmax) {
    const Vec s = softmax(x);
    for (int32_t i = 0; i < k; ++i) w[i] = s[idx[i]];
  } else if (o.score == RouterScore::kSoftmax) {
    Vec xc(k);
    for (int32_t i = 0; i < k; ++i) xc[i] = x[idx[i]];
    w = softmax(xc);
  } else {
    double sum = 1e-20;
    for (int32_t i = 0; i < k; ++i) sum += w[i] = act(o.score, x[idx[i]]);
    if (k > 1) {
      for (double& v : w) v /= sum;
    }
  }
  for (double& v : w) v *= o.scale;
  return w;
}

inline RowResult route_row(const Vec& x, const Options& o) {
  RowResult r;
  const auto chosen = choose(x, o);
  const Vec w = weights(x, chosen, o);
  std::vector<int32_t> order(o.k);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    if (ranks_before(w[a], w[b]) || ranks_before(w[b], w[a])) return ranks_before(w[a], w[b]);
    return chosen[a] < chosen[b];
  });
  for (int32_t i : order) {
    r.idx.push_back(chosen[i]);
    r.w.push_back(w[i]);
  }
  return r;
}

// Aux scores of one row, dense and normalised.
inline Vec aux_scores_row(const Vec& x, RouterScore score) {
  if (score == RouterScore::kSoftmax) return softmax(x);
  Vec q(x.size());
  double sum = 1e-20;
  for (size_t e = 0; e < x.size(); ++e) sum += q[e] = act(score, x[e]);
  for (double& v : q) v /= sum;
  return q;
}

// Central difference of f at x along every coordinate.
template <typename F>
inline Vec numeric_grad(const Vec& x, F f, double h = 1e-6) {
  Vec g(x.size());
  Vec xp = x;
  for (size_t i = 0; i < x.size(); ++i) {
    xp[i] = x[i] + h;
    const double fp = f(xp);
    xp[i] = x[i] - h;
    const double fm = f(xp);
    xp[i] = x[i];
    g[i] = (fp - fm) / (2 * h);
  }
  return g;
}

inline Vec row_of(const HostTensor& t, int64_t r) {
  Vec v(t.shape[1]);
  for (int64_t j = 0; j < t.shape[1]; ++j) v[j] = t.get({r, j});
  return v;
}

inline RouteOptions to_route_options(const Options& o, RouterImpl impl) {
  RouteOptions r;
  r.k = o.k;
  r.score = o.score;
  r.pre_softmax = o.pre_softmax;
  r.num_groups = o.num_groups;
  r.group_topk = o.group_topk;
  r.scaling_factor = static_cast<float>(o.scale);
  r.expert_bias = o.bias;
  r.impl = impl;
  return r;
}

// Options without bias, from the fields a test's table of cases sets.
inline Options make_options(RouterScore score, bool pre_softmax, int32_t k, int32_t num_groups,
                            int32_t group_topk, double scale) {
  Options o;
  o.score = score;
  o.pre_softmax = pre_softmax;
  o.k = k;
  o.num_groups = num_groups;
  o.group_topk = group_topk;
  o.scale = scale;
  return o;
}

// Checks route's outputs for every row against the oracle. With `skip_near_ties`, rows whose
// choice the oracle finds within 1e-6 of a different one but not tied with it (f32 cannot decide
// those) are not compared; returns how many were skipped. Exact ties (bf16 logits make many) are
// decided by the tie rule, on both sides alike: always compared.
inline int64_t expect_route_matches(const HostTensor& logits, const Options& o, HostTensor& probs,
                                    HostTensor& map, HostTensor& idx, HostTensor& w, double tol,
                                    bool skip_near_ties = false) {
  const int64_t T = logits.shape[0], E = logits.shape[1];
  int64_t skipped = 0;
  for (int64_t t = 0; t < T; ++t) {
    double margin = 1.0;
    choose(row_of(logits, t), o, &margin);
    if (skip_near_ties && margin > 0 && margin < 1e-6) {
      ++skipped;
      continue;
    }
    const RowResult want = route_row(row_of(logits, t), o);
    for (int32_t i = 0; i < o.k; ++i) {
      EXPECT_EQ(idx.get({t, i}), want.idx[i]) << "row " << t << " slot " << i;
      EXPECT_NEAR(w.get({t, i}), want.w[i], tol * (1 + std::fabs(want.w[i])))
          << "row " << t << " slot " << i;
    }
    Vec dense(E, 0.0);
    for (int32_t i = 0; i < o.k; ++i) dense[want.idx[i]] = want.w[i];
    for (int64_t e = 0; e < E; ++e) {
      EXPECT_EQ(map.get({t, e}), dense[e] != 0.0 ? 1.0 : 0.0) << "row " << t << " expert " << e;
      EXPECT_NEAR(probs.get({t, e}), dense[e], tol * (1 + std::fabs(dense[e])))
          << "row " << t << " expert " << e;
    }
    if (testing::Test::HasFailure()) return skipped;
  }
  return skipped;
}

}  // namespace moekit::router_oracle
