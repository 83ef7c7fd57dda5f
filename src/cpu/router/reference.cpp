// Scalar reference of the router: one token at a time, std:: math, sorts instead of selection,
// no threads. Written to be read against SPEC.md section 2, not to be fast.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "cpu/convert.h"
#include "cpu/router/problems.h"

namespace moekit::detail {
namespace {

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

float activation(RouterScore score, float x) {
  if (score == RouterScore::kSigmoid) return sigmoid(x);
  return std::sqrt(std::max(x, 0.0f) + std::log1p(std::exp(-std::fabs(x))));
}

// d activation / dx.
float activation_grad(RouterScore score, float x) {
  const float sg = sigmoid(x);
  if (score == RouterScore::kSigmoid) return sg * (1.0f - sg);
  const float s = activation(score, x);
  return s > 0.0f ? sg / (2.0f * s) : 0.0f;
}

std::vector<float> softmax(const std::vector<float>& x) {
  const float m = *std::max_element(x.begin(), x.end());
  std::vector<float> p(x.size());
  float sum = 0.0f;
  for (size_t i = 0; i < x.size(); ++i) sum += p[i] = std::exp(x[i] - m);
  for (float& v : p) v /= sum;
  return p;
}

// The order every ranking here uses (router.h's NaN rule): larger first, NaN after every
// number (-inf too), NaNs equal: a strict weak order, so valid indices and no out-of-bounds sort
// whatever the input.
bool before(float a, float b) { return !std::isnan(a) && (std::isnan(b) || a > b); }

// Indices of the `n` largest key[i] among those with allowed[i], best first; equal keys keep
// index order (stable sort), so the lower index wins a tie.
std::vector<int32_t> top_indices(const std::vector<float>& key, const std::vector<bool>& allowed,
                                 int32_t n) {
  std::vector<int32_t> idx;
  for (int32_t i = 0; i < static_cast<int32_t>(key.size()); ++i) {
    if (allowed[i]) idx.push_back(i);
  }
  std::stable_sort(idx.begin(), idx.end(),
                   [&](int32_t a, int32_t b) { return before(key[a], key[b]); });
  idx.resize(std::min<size_t>(idx.size(), n));
  return idx;
}

std::vector<float> load_row(const ConstTensorView& v, int64_t t) {
  std::vector<float> row(v.shape[1]);
  for (int64_t e = 0; e < v.shape[1]; ++e) row[e] = load_as_float(row_ptr(v, t), v.dtype, e);
  return row;
}

void store(const TensorView& v, int64_t t, int64_t j, float x) {
  store_float(row_ptr(v, t), v.dtype, j, x);
}

float load(const ConstTensorView& v, int64_t t, int64_t j) {
  return load_as_float(row_ptr(v, t), v.dtype, j);
}

}  // namespace

void route_row_ref(const RouteOptions& o, const float* logits, int64_t E, int32_t* experts,
                   float* weights) {
  const std::vector<float> x(logits, logits + E);
  const bool softmax_score = o.score == RouterScore::kSoftmax;
  // s: the scores the weights are taken from; key: the scores the experts are chosen by.
  std::vector<float> s(E);
  if (softmax_score) {
    s = o.pre_softmax ? softmax(x) : x;
  } else {
    for (int64_t e = 0; e < E; ++e) s[e] = activation(o.score, x[e]);
  }
  std::vector<float> key = s;
  if (!o.expert_bias.empty()) {
    for (int64_t e = 0; e < E; ++e) key[e] += o.expert_bias[e];
  }
  std::vector<bool> allowed(E, true);
  if (o.num_groups > 0) {
    const int64_t per_group = E / o.num_groups;
    std::vector<float> group_score(o.num_groups);
    for (int32_t g = 0; g < o.num_groups; ++g) {
      std::vector<float> members(key.begin() + g * per_group, key.begin() + (g + 1) * per_group);
      std::stable_sort(members.begin(), members.end(), before);
      group_score[g] = std::accumulate(members.begin(), members.begin() + o.k / o.group_topk, 0.0f);
    }
    const std::vector<int32_t> kept =
        top_indices(group_score, std::vector<bool>(o.num_groups, true), o.group_topk);
    std::fill(allowed.begin(), allowed.end(), false);
    for (int32_t g : kept) {
      for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e) allowed[e] = true;
    }
  }
  const std::vector<int32_t> chosen = top_indices(key, allowed, o.k);

  std::vector<float> w(o.k);
  if (softmax_score && !o.pre_softmax) {
    std::vector<float> xc(o.k);
    for (int32_t i = 0; i < o.k; ++i) xc[i] = x[chosen[i]];
    w = softmax(xc);
  } else {
    for (int32_t i = 0; i < o.k; ++i) w[i] = s[chosen[i]];
    if (!softmax_score && o.k > 1) {
      const float sum = std::accumulate(w.begin(), w.end(), 0.0f) + kNormEps;
      for (float& v : w) v /= sum;
    }
  }
  for (float& v : w) v *= o.scaling_factor;

  // Descending weight (NaN last), ties to the lower index.
  std::vector<int32_t> order(o.k);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return before(w[a], w[b]) || before(w[b], w[a]) ? before(w[a], w[b]) : chosen[a] < chosen[b];
  });
  for (int32_t i = 0; i < o.k; ++i) {
    experts[i] = chosen[order[i]];
    weights[i] = w[order[i]];
  }
}

Status route_ref(const RouteProblem& p) {
  const RouteOptions& o = p.options;
  const int64_t T = p.logits.shape[0], E = p.logits.shape[1];
  std::vector<int32_t> chosen(o.k);
  std::vector<float> w(o.k);
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<float> x = load_row(p.logits, t);
    route_row_ref(o, x.data(), E, chosen.data(), w.data());
    for (int64_t e = 0; e < E; ++e) {
      if (p.out.probs.data) store(p.out.probs, t, e, 0.0f);
      if (p.out.routing_map.data) {
        static_cast<uint8_t*>(p.out.routing_map.data)[t * p.out.routing_map.stride[0] + e] = 0;
      }
    }
    for (int32_t i = 0; i < o.k; ++i) {
      const int32_t e = chosen[i];
      const float v = w[i];
      if (p.out.probs.data) store(p.out.probs, t, e, v);
      if (p.out.routing_map.data) {
        static_cast<uint8_t*>(p.out.routing_map.data)[t * p.out.routing_map.stride[0] + e] = 1;
      }
      if (p.out.topk_indices.data) {
        static_cast<int32_t*>(p.out.topk_indices.data)[t * p.out.topk_indices.stride[0] + i] = e;
      }
      if (p.out.topk_weights.data) store(p.out.topk_weights, t, i, v);
    }
  }
  return {};
}

void route_backward_chosen_row_ref(const RouteOptions& o, const float* g, const float* xc,
                                   float* dxc) {
  if (o.score == RouterScore::kSoftmax) {
    // w = softmax(x[idx]): dx[idx] = w * (g - <g, w>).
    const std::vector<float> w = softmax(std::vector<float>(xc, xc + o.k));
    float dot = 0.0f;
    for (int32_t i = 0; i < o.k; ++i) dot += g[i] * w[i];
    for (int32_t i = 0; i < o.k; ++i) dxc[i] = w[i] * (g[i] - dot);
    return;
  }
  // w = s[idx] / (sum + eps) when k > 1: ds = (g - <g, w>) / (sum + eps).
  std::vector<float> s(o.k);
  float sum = kNormEps;
  for (int32_t i = 0; i < o.k; ++i) sum += s[i] = activation(o.score, xc[i]);
  float dot = 0.0f;
  for (int32_t i = 0; i < o.k; ++i) dot += g[i] * s[i] / sum;
  for (int32_t i = 0; i < o.k; ++i) {
    const float ds = o.k > 1 ? (g[i] - dot) / sum : g[i];
    dxc[i] = ds * activation_grad(o.score, xc[i]);
  }
}

Status route_backward_ref(const RouteBackwardProblem& p) {
  const RouteOptions& o = p.options;
  const int64_t T = p.logits.shape[0], E = p.logits.shape[1];
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<float> x = load_row(p.logits, t);
    std::vector<int32_t> idx(o.k);
    std::vector<float> g(o.k, 0.0f);  // cotangent of each chosen weight
    for (int32_t i = 0; i < o.k; ++i) {
      idx[i] = static_cast<const int32_t*>(p.topk_indices.data)[t * p.topk_indices.stride[0] + i];
      if (p.d_probs.data) g[i] += load(p.d_probs, t, idx[i]);
      if (p.d_topk_weights.data) g[i] += load(p.d_topk_weights, t, i);
      g[i] *= o.scaling_factor;
    }
    std::vector<float> dx(E, 0.0f);
    if (o.score == RouterScore::kSoftmax && o.pre_softmax) {
      // w_i = s[idx_i], s = softmax(x): dx = s * (ge - <ge, s>), ge the cotangent of s.
      const std::vector<float> s = softmax(x);
      std::vector<float> ge(E, 0.0f);
      for (int32_t i = 0; i < o.k; ++i) ge[idx[i]] += g[i];
      float dot = 0.0f;
      for (int64_t e = 0; e < E; ++e) dot += ge[e] * s[e];
      for (int64_t e = 0; e < E; ++e) dx[e] = s[e] * (ge[e] - dot);
    } else {
      std::vector<float> xc(o.k), dxc(o.k);
      for (int32_t i = 0; i < o.k; ++i) xc[i] = x[idx[i]];
      route_backward_chosen_row_ref(o, g.data(), xc.data(), dxc.data());
      for (int32_t i = 0; i < o.k; ++i) dx[idx[i]] += dxc[i];
    }
    for (int64_t e = 0; e < E; ++e) store(p.d_logits, t, e, dx[e]);
  }
  return {};
}

namespace {
// The aux scores of one row: softmax, or the activation normalised over all E. Also returns the
// normaliser of the activation (sum + eps).
std::vector<float> aux_row(RouterScore score, const std::vector<float>& x, float* norm) {
  if (score == RouterScore::kSoftmax) return softmax(x);
  std::vector<float> q(x.size());
  float sum = kNormEps;
  for (size_t e = 0; e < x.size(); ++e) sum += q[e] = activation(score, x[e]);
  for (float& v : q) v /= sum;
  *norm = sum;
  return q;
}
}  // namespace

Status aux_scores_ref(const AuxScoresProblem& p) {
  const int64_t T = p.logits.shape[0], E = p.logits.shape[1];
  for (int64_t t = 0; t < T; ++t) {
    float norm = 0.0f;
    const std::vector<float> q = aux_row(p.score, load_row(p.logits, t), &norm);
    if (p.scores.data) {
      for (int64_t e = 0; e < E; ++e) store(p.scores, t, e, q[e]);
    }
    if (p.routing_map.data) {
      uint8_t* map = static_cast<uint8_t*>(p.routing_map.data) + t * p.routing_map.stride[0];
      std::fill(map, map + E, 0);
      for (int32_t e : top_indices(q, std::vector<bool>(E, true), p.k)) map[e] = 1;
    }
  }
  return {};
}

Status aux_scores_backward_ref(const AuxScoresBackwardProblem& p) {
  const int64_t T = p.logits.shape[0], E = p.logits.shape[1];
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<float> x = load_row(p.logits, t);
    const std::vector<float> dq = load_row(p.d_scores, t);
    float norm = 0.0f;
    const std::vector<float> q = aux_row(p.score, x, &norm);
    float dot = 0.0f;
    for (int64_t e = 0; e < E; ++e) dot += dq[e] * q[e];
    for (int64_t e = 0; e < E; ++e) {
      const float dx = p.score == RouterScore::kSoftmax
                           ? q[e] * (dq[e] - dot)
                           : (dq[e] - dot) / norm * activation_grad(p.score, x[e]);
      store(p.d_logits, t, e, dx);
    }
  }
  return {};
}

}  // namespace moekit::detail
