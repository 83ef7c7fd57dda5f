// The expert FFN activations and the MoE layer against an oracle written here in double
// precision. The oracle is the layer's dense form, with no permutation and no grouped matmul:
//   out[t] = sum over the kept (t, e) of w[t, e] * FFN_e(x[t])  +  shared(x[t])
// with the routing weights, the capacity's drops and the losses written out from SPEC.md. The
// layer's gradients are checked against central finite differences of that oracle, with the
// discrete choices (experts chosen, tokens dropped) held fixed.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "host_tensor.h"
#include "moekit/layer.h"
#include "moekit/ragged_dot.h"

namespace moekit {
namespace {

using Vec = std::vector<double>;

// ---------------------------------------------------------------------------------------------
// Activations in double.

constexpr double kGeluC = 0.7978845608028654, kGeluA = 0.044715;

double act_value(Activation a, double x) {
  switch (a) {
    case Activation::kSwiGLU:
      return x / (1.0 + std::exp(-x));
    case Activation::kGeGLU:
    case Activation::kGelu:
      return 0.5 * x * (1.0 + std::tanh(kGeluC * (x + kGeluA * x * x * x)));
    case Activation::kRelu:
      return x > 0 ? x : 0.0;
  }
  return 0;
}

// One row: h [W] -> a [F].
Vec act_row(Activation a, const Vec& h) {
  const size_t F = is_gated(a) ? h.size() / 2 : h.size();
  Vec out(F);
  for (size_t j = 0; j < F; ++j) {
    out[j] = act_value(a, h[j]) * (is_gated(a) ? h[F + j] : 1.0);
  }
  return out;
}

const char* act_name(Activation a) {
  switch (a) {
    case Activation::kSwiGLU:
      return "swiglu";
    case Activation::kGeGLU:
      return "geglu";
    case Activation::kGelu:
      return "gelu";
    case Activation::kRelu:
      return "relu";
  }
  return "?";
}

constexpr Activation kActivations[] = {Activation::kSwiGLU, Activation::kGeGLU, Activation::kGelu,
                                       Activation::kRelu};

// Values in [-4, 4] that keep away from ReLU's kink at 0 by at least 1e-3 (finite differences).
void fill_away_from_zero(HostTensor& t, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-4.f, 4.f);
  for (size_t i = 0; i < t.bytes.size() / dtype_size(t.dtype); ++i) {
    float v = u(rng);
    if (std::fabs(v) < 1e-3f) v = 0.5f;
    t.set_flat(static_cast<int64_t>(i), bf16_to_float(float_to_bf16(v)));
  }
}

struct ActCase {
  Activation act;
  DType dt;
  int64_t N, F;
  ActivationImpl impl;
};

class ActivationGrid : public testing::TestWithParam<ActCase> {};

TEST_P(ActivationGrid, MatchesTheFormulaAndItsFiniteDifferences) {
  const ActCase c = GetParam();
  const int64_t W = is_gated(c.act) ? 2 * c.F : c.F;
  std::mt19937 rng(7);
  HostTensor h(c.dt, {c.N, W}, /*row_pad=*/3), d_a(c.dt, {c.N, c.F});
  fill_away_from_zero(h, rng);
  d_a.fill_random(rng);
  HostTensor a(c.dt, {c.N, c.F}), d_h(c.dt, {c.N, W}, /*row_pad=*/5);
  ASSERT_TRUE(activation(h.in(), c.act, a.mut(), c.impl).ok());
  ASSERT_TRUE(activation_backward(h.in(), d_a.in(), c.act, d_h.mut(), c.impl).ok());

  const double tol = c.dt == DType::kF32 ? 2e-6 : 1.0 / 128;  // relative; bf16: one rounding
  for (int64_t r = 0; r < c.N; ++r) {
    Vec row(W);
    for (int64_t j = 0; j < W; ++j) row[j] = h.get({r, j});
    const Vec want = act_row(c.act, row);
    for (int64_t j = 0; j < c.F; ++j) {
      ASSERT_NEAR(a.get({r, j}), want[j], tol * (1 + std::fabs(want[j]))) << "a " << r << "," << j;
    }
    // d_h[j] = sum_i d_a[i] * d a[i] / d h[j], by central differences of the double formula.
    for (int64_t j = 0; j < W; ++j) {
      const double eps = 1e-5;
      Vec hi = row, lo = row;
      hi[j] += eps, lo[j] -= eps;
      const Vec ah = act_row(c.act, hi), al = act_row(c.act, lo);
      double g = 0;
      for (int64_t i = 0; i < c.F; ++i) g += d_a.get({r, i}) * (ah[i] - al[i]) / (2 * eps);
      ASSERT_NEAR(d_h.get({r, j}), g, 1e-4 + tol * (1 + std::fabs(g))) << "d_h " << r << "," << j;
    }
  }
}

std::vector<ActCase> act_grid() {
  std::vector<ActCase> v;
  for (Activation a : kActivations) {
    for (DType dt : {DType::kF32, DType::kBF16}) {
      for (auto [N, F] : {std::pair<int64_t, int64_t>{0, 7}, {1, 1}, {3, 7}, {5, 111}, {2, 500}}) {
        for (ActivationImpl impl : {ActivationImpl::kVectorized, ActivationImpl::kReference}) {
          v.push_back({a, dt, N, F, impl});
        }
      }
    }
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Activation, ActivationGrid, testing::ValuesIn(act_grid()),
                         [](const testing::TestParamInfo<ActCase>& i) {
                           const ActCase& c = i.param;
                           return fmt::format("{}_{}_N{}_F{}_{}", act_name(c.act), dtype_name(c.dt),
                                              c.N, c.F,
                                              c.impl == ActivationImpl::kReference ? "ref" : "vec");
                         });

TEST(Activation, LargeInputsStayFiniteAndNamedErrorsWriteNothing) {
  // Past exp's range and where x^3 would overflow: silu -> 0 or x, gelu -> 0 or x.
  HostTensor h(DType::kF32, {1, 8}), a(DType::kF32, {1, 4}), d_h(DType::kF32, {1, 8});
  const float xs[4] = {-1e30f, -200.f, 200.f, 1e30f};
  for (Activation act : {Activation::kSwiGLU, Activation::kGeGLU}) {
    for (int j = 0; j < 4; ++j) h.set({0, j}, xs[j]), h.set({0, 4 + j}, 1.0);
    HostTensor d_a(DType::kF32, {1, 4});
    d_a.fill(1.0f);
    ASSERT_TRUE(activation(h.in(), act, a.mut()).ok());
    ASSERT_TRUE(activation_backward(h.in(), d_a.in(), act, d_h.mut()).ok());
    EXPECT_EQ(a.get({0, 0}), 0.0) << act_name(act);
    EXPECT_EQ(a.get({0, 3}), 1e30f) << act_name(act);
    for (int j = 0; j < 8; ++j) EXPECT_TRUE(std::isfinite(d_h.get({0, j}))) << act_name(act) << j;
  }
  HostTensor odd(DType::kF32, {2, 7});
  a.fill(3.0f);
  const Status s = activation(odd.in(), Activation::kSwiGLU, a.mut());
  EXPECT_EQ(s.argument(), "h.shape[1]");
  EXPECT_EQ(a.get({0, 0}), 3.0);
  HostTensor a_wrong(DType::kF32, {2, 4});
  const Status s2 = activation(h.in(), Activation::kSwiGLU, a_wrong.mut());
  EXPECT_EQ(s2.argument(), "a.shape") << s2.message();  // h [1, 8] gives a [1, 4]
}

// ---------------------------------------------------------------------------------------------
// The layer's oracle.

struct Params {  // the differentiable inputs, in double
  Vec x, router, w_in, w_out, shared_in, shared_out, b_in, b_out;
};

struct LayerCase {
  std::string name;
  int64_t T, H, F, E, k, Fs = 0;
  RouterScore score = RouterScore::kSoftmax;
  bool pre_softmax = false;
  int32_t num_groups = 0, group_topk = 0;
  float scale = 1.0f;
  bool bias = false;
  Activation act = Activation::kSwiGLU;
  double capacity_factor = 0;
  DropPolicy policy = DropPolicy::kProbs;
  bool pad_to_capacity = false;
  int64_t align = 1;
  float aux_coeff = 0, z_coeff = 0;
  int32_t sequences = 0;
  bool b_in = false, b_out = false;  // the expert FFNs' biases
};

// The discrete decisions, made once from the unperturbed parameters and then held fixed.
struct Choices {
  std::vector<std::vector<int32_t>> chosen;  // [T][k] experts
  std::vector<std::vector<bool>> kept;       // [T][k] not dropped by capacity
  std::vector<std::vector<int32_t>> counts;  // [B][E] tokens per expert for the aux loss
  std::vector<int32_t> rows;                 // [E] rows of each expert's block (padding included)
};

struct Oracle {
  LayerCase c;
  std::vector<float> bias;  // [E] or empty
  Vec G;                    // [T, H] the output's cotangent
  double d_aux = 0, d_z = 0;

  int64_t W() const { return is_gated(c.act) ? 2 * c.F : c.F; }
  int64_t Ws() const { return is_gated(c.act) ? 2 * c.Fs : c.Fs; }

  Vec logits(const Params& p) const {
    Vec l(c.T * c.E, 0.0);
    for (int64_t t = 0; t < c.T; ++t)
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t e = 0; e < c.E; ++e)
          l[t * c.E + e] += p.x[t * c.H + h] * p.router[h * c.E + e];
    return l;
  }
  double score_act(double x) const {
    return c.score == RouterScore::kSigmoid ? 1.0 / (1.0 + std::exp(-x))
                                            : std::sqrt(std::log1p(std::exp(x)));
  }
  static Vec softmax(const double* x, int64_t n) {
    const double m = *std::max_element(x, x + n);
    Vec p(n);
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += p[i] = std::exp(x[i] - m);
    for (double& v : p) v /= s;
    return p;
  }
  // Token t's selection scores (before the bias) over all E.
  Vec scores(const Vec& l, int64_t t) const {
    const double* x = &l[t * c.E];
    if (c.score == RouterScore::kSoftmax) {
      return c.pre_softmax ? softmax(x, c.E) : Vec(x, x + c.E);
    }
    Vec s(c.E);
    for (int64_t e = 0; e < c.E; ++e) s[e] = score_act(x[e]);
    return s;
  }
  // The k experts of token t: top-k of scores + bias, within the best groups.
  std::vector<int32_t> choose(const Vec& l, int64_t t) const {
    Vec key = scores(l, t);
    if (!bias.empty())
      for (int64_t e = 0; e < c.E; ++e) key[e] += bias[e];
    std::vector<bool> allowed(c.E, true);
    if (c.num_groups > 0) {
      const int64_t per = c.E / c.num_groups, top = c.k / c.group_topk;
      std::vector<std::pair<double, int32_t>> g;
      for (int32_t gi = 0; gi < c.num_groups; ++gi) {
        Vec in(key.begin() + gi * per, key.begin() + (gi + 1) * per);
        std::sort(in.rbegin(), in.rend());
        g.push_back({-std::accumulate(in.begin(), in.begin() + top, 0.0), gi});
      }
      std::sort(g.begin(), g.end());
      std::fill(allowed.begin(), allowed.end(), false);
      for (int32_t i = 0; i < c.group_topk; ++i)
        for (int64_t e = 0; e < per; ++e) allowed[g[i].second * per + e] = true;
    }
    std::vector<int32_t> idx;
    for (int32_t e = 0; e < c.E; ++e)
      if (allowed[e]) idx.push_back(e);
    std::sort(idx.begin(), idx.end(),
              [&](int32_t a, int32_t b) { return key[a] != key[b] ? key[a] > key[b] : a < b; });
    idx.resize(c.k);
    return idx;
  }
  // Token t's weights at its chosen experts.
  Vec weights(const Vec& l, int64_t t, const std::vector<int32_t>& chosen) const {
    const double* x = &l[t * c.E];
    Vec w(c.k);
    if (c.score == RouterScore::kSoftmax && !c.pre_softmax) {
      Vec sel(c.k);
      for (int64_t j = 0; j < c.k; ++j) sel[j] = x[chosen[j]];
      w = softmax(sel.data(), c.k);
    } else {
      const Vec s = scores(l, t);
      double sum = 0;
      for (int64_t j = 0; j < c.k; ++j) sum += w[j] = s[chosen[j]];
      if (c.score != RouterScore::kSoftmax && c.k > 1)
        for (double& v : w) v /= sum + 1e-20;
    }
    for (double& v : w) v *= c.scale;
    return w;
  }
  // The aux-loss scores of token t: normalised over all E.
  Vec aux_scores(const Vec& l, int64_t t) const {
    if (c.score == RouterScore::kSoftmax) return softmax(&l[t * c.E], c.E);
    Vec s = scores(l, t);
    const double sum = std::accumulate(s.begin(), s.end(), 0.0);
    for (double& v : s) v /= sum + 1e-20;
    return s;
  }

  Choices decide(const Params& p) const {
    const Vec l = logits(p);
    Choices ch;
    ch.chosen.resize(c.T);
    ch.kept.assign(c.T, std::vector<bool>(c.k, true));
    std::vector<std::vector<std::pair<int64_t, int64_t>>> slots(c.E);  // (t, j) per expert
    std::vector<Vec> w(c.T);
    for (int64_t t = 0; t < c.T; ++t) {
      ch.chosen[t] = choose(l, t);
      w[t] = weights(l, t, ch.chosen[t]);
      for (int64_t j = 0; j < c.k; ++j) slots[ch.chosen[t][j]].push_back({t, j});
    }
    int64_t cap = -1;
    if (c.capacity_factor > 0) {
      cap =
          static_cast<int64_t>(std::ceil(static_cast<double>(c.T) * c.k / c.E * c.capacity_factor));
      for (auto& s : slots) {
        if (c.policy == DropPolicy::kProbs) {  // highest weight first; ties: earlier token, slot
          std::stable_sort(s.begin(), s.end(), [&](auto a, auto b) {
            return w[a.first][a.second] > w[b.first][b.second];
          });
        }
        for (size_t i = cap; i < s.size(); ++i) ch.kept[s[i].first][s[i].second] = false;
      }
    }
    for (int64_t e = 0; e < c.E; ++e) {
      int64_t n =
          c.pad_to_capacity ? cap : std::min<int64_t>(slots[e].size(), cap < 0 ? INT64_MAX : cap);
      ch.rows.push_back(static_cast<int32_t>((n + c.align - 1) / c.align * c.align));
    }
    const int64_t B = std::max<int32_t>(c.sequences, 1), S = c.T / B;
    ch.counts.assign(B, std::vector<int32_t>(c.E, 0));
    for (int64_t t = 0; t < c.T; ++t) {
      const Vec s = aux_scores(l, t);
      std::vector<int32_t> idx(c.E);
      std::iota(idx.begin(), idx.end(), 0);
      std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return s[a] > s[b]; });
      for (int64_t j = 0; j < c.k; ++j) ++ch.counts[t / S][idx[j]];
    }
    return ch;
  }

  // FFN rows: a = act(v @ win + bin) [F] then a @ wout + bout [H]; win [H, W] and wout [F, H]
  // row-major, the biases bin [W] and bout [H] or null.
  Vec ffn(const double* v, const double* win, const double* wout, int64_t F, int64_t Wd,
          const double* bin = nullptr, const double* bout = nullptr) const {
    Vec hrow(Wd, 0.0);
    for (int64_t i = 0; i < c.H; ++i)
      for (int64_t j = 0; j < Wd; ++j) hrow[j] += v[i] * win[i * Wd + j];
    if (bin)
      for (int64_t j = 0; j < Wd; ++j) hrow[j] += bin[j];
    const Vec a = act_row(c.act, hrow);
    Vec y(c.H, 0.0);
    for (int64_t j = 0; j < F; ++j)
      for (int64_t i = 0; i < c.H; ++i) y[i] += a[j] * wout[j * c.H + i];
    if (bout)
      for (int64_t i = 0; i < c.H; ++i) y[i] += bout[i];
    return y;
  }

  struct Result {
    Vec out;
    double aux = 0, z = 0, loss = 0;
  };
  Result run(const Params& p, const Choices& ch) const {
    const Vec l = logits(p);
    Result r;
    r.out.assign(c.T * c.H, 0.0);
    for (int64_t t = 0; t < c.T; ++t) {
      const double* v = &p.x[t * c.H];
      const Vec w = weights(l, t, ch.chosen[t]);
      for (int64_t j = 0; j < c.k; ++j) {
        if (!ch.kept[t][j]) continue;
        const int64_t e = ch.chosen[t][j];
        const Vec y =
            ffn(v, &p.w_in[e * c.H * W()], &p.w_out[e * c.F * c.H], c.F, W(),
                c.b_in ? &p.b_in[e * W()] : nullptr, c.b_out ? &p.b_out[e * c.H] : nullptr);
        for (int64_t i = 0; i < c.H; ++i) r.out[t * c.H + i] += w[j] * y[i];
      }
      if (c.Fs > 0) {
        const Vec y = ffn(v, p.shared_in.data(), p.shared_out.data(), c.Fs, Ws());
        for (int64_t i = 0; i < c.H; ++i) r.out[t * c.H + i] += y[i];
      }
    }
    if (c.aux_coeff != 0) {  // E * coeff / (k * S^2) * sum_e (sum_t scores) * counts, per sequence
      const int64_t B = std::max<int32_t>(c.sequences, 1), S = c.T / B;
      for (int64_t b = 0; b < B; ++b) {
        Vec col(c.E, 0.0);
        for (int64_t t = b * S; t < (b + 1) * S; ++t) {
          const Vec s = aux_scores(l, t);
          for (int64_t e = 0; e < c.E; ++e) col[e] += s[e];
        }
        double sum = 0;
        for (int64_t e = 0; e < c.E; ++e) sum += col[e] * ch.counts[b][e];
        r.aux += c.E * static_cast<double>(c.aux_coeff) / (c.k * double(S) * S) * sum / B;
      }
    }
    if (c.z_coeff != 0) {
      for (int64_t t = 0; t < c.T; ++t) {
        const double* x = &l[t * c.E];
        const double m = *std::max_element(x, x + c.E);
        double s = 0;
        for (int64_t e = 0; e < c.E; ++e) s += std::exp(x[e] - m);
        const double lse = m + std::log(s);
        r.z += c.z_coeff * lse * lse / c.T;
      }
    }
    r.loss = d_aux * r.aux + d_z * r.z;
    for (size_t i = 0; i < r.out.size(); ++i) r.loss += G[i] * r.out[i];
    return r;
  }
};

// Copies a float tensor's elements into a double vector, and back.
Vec to_vec(const HostTensor& t) {
  Vec v(t.bytes.size() / dtype_size(t.dtype));
  for (size_t i = 0; i < v.size(); ++i) v[i] = t.get_flat(static_cast<int64_t>(i));
  return v;
}

// The tensors of one layer call, in dtype dt, with the same values whatever dt.
struct LayerRun {
  LayerCase c;
  DType dt;
  MoeLayerConfig cfg;
  HostTensor x, router, w_in, w_out, shared_in, shared_out, b_in, b_out, out, d_out;
  std::vector<float> bias;

  LayerRun(const LayerCase& lc, DType t, uint64_t seed)
      : c(lc),
        dt(t),
        x(t, {lc.T, lc.H}),
        router(t, {lc.H, lc.E}),
        w_in(t, {lc.E, lc.H, is_gated(lc.act) ? 2 * lc.F : lc.F}),
        w_out(t, {lc.E, lc.F, lc.H}),
        shared_in(t, {lc.H, is_gated(lc.act) ? 2 * lc.Fs : lc.Fs}),
        shared_out(t, {lc.Fs, lc.H}),
        b_in(t, {lc.E, is_gated(lc.act) ? 2 * lc.F : lc.F}),
        b_out(t, {lc.E, lc.H}),
        out(t, {lc.T, lc.H}),
        d_out(t, {lc.T, lc.H}) {
    std::mt19937 rng(static_cast<uint32_t>(seed));
    for (HostTensor* h : {&x, &router, &w_in, &w_out, &shared_in, &shared_out, &d_out})
      h->fill_random(rng);
    b_in.fill_random(rng);
    b_out.fill_random(rng);
    if (lc.bias) {
      std::uniform_real_distribution<float> u(-0.1f, 0.1f);
      for (int64_t e = 0; e < lc.E; ++e) bias.push_back(u(rng));
    }
    cfg.hidden = lc.H, cfg.ffn = lc.F, cfg.num_experts = lc.E, cfg.shared_ffn = lc.Fs;
    cfg.route.k = static_cast<int32_t>(lc.k);
    cfg.route.score = lc.score;
    cfg.route.pre_softmax = lc.pre_softmax;
    cfg.route.num_groups = lc.num_groups;
    cfg.route.group_topk = lc.group_topk;
    cfg.route.scaling_factor = lc.scale;
    cfg.route.expert_bias = bias;
    cfg.activation = lc.act;
    cfg.capacity_factor = lc.capacity_factor;
    cfg.drop_policy = lc.policy;
    cfg.pad_to_capacity = lc.pad_to_capacity;
    cfg.align_size = lc.align;
    cfg.aux_loss_coeff = lc.aux_coeff;
    cfg.z_loss_coeff = lc.z_coeff;
    cfg.aux_loss_sequences = lc.sequences;
  }
  MoeLayerWeights weights() {
    MoeLayerWeights w{.router = router.in(), .w_in = w_in.in(), .w_out = w_out.in()};
    if (c.Fs > 0) w.shared_in = shared_in.in(), w.shared_out = shared_out.in();
    if (c.b_in) w.b_in = b_in.in();
    if (c.b_out) w.b_out = b_out.in();
    return w;
  }
  Params params() const {
    return {to_vec(x),         to_vec(router),     to_vec(w_in), to_vec(w_out),
            to_vec(shared_in), to_vec(shared_out), to_vec(b_in), to_vec(b_out)};
  }
  Oracle oracle(double d_aux, double d_z) const { return {c, bias, to_vec(d_out), d_aux, d_z}; }
  // The same values with w_in and w_out stored [E, out, in] (config.expert_weights_transposed).
  void transpose_expert_weights() {
    w_in = transposed_matrices(w_in);
    w_out = transposed_matrices(w_out);
    cfg.expert_weights_transposed = true;
  }
};

// 64-byte aligned bytes.
using Bytes = std::vector<std::byte, Aligned64Allocator<std::byte>>;

struct Grads {
  HostTensor d_x, router, w_in, w_out, shared_in, shared_out, b_in, b_out;
  explicit Grads(LayerRun& r, DType t)
      : d_x(t, r.x.shape),
        router(t, r.router.shape),
        w_in(t, r.w_in.shape),
        w_out(t, r.w_out.shape),
        shared_in(t, r.shared_in.shape),
        shared_out(t, r.shared_out.shape),
        b_in(t, r.b_in.shape),
        b_out(t, r.b_out.shape) {}
  MoeLayerWeightGrads views(bool shared, bool with_b_in = false, bool with_b_out = false) {
    MoeLayerWeightGrads g{.router = router.mut(), .w_in = w_in.mut(), .w_out = w_out.mut()};
    if (shared) g.shared_in = shared_in.mut(), g.shared_out = shared_out.mut();
    if (with_b_in) g.b_in = b_in.mut();
    if (with_b_out) g.b_out = b_out.mut();
    return g;
  }
};

// gtest prints a case by its name.
void PrintTo(const LayerCase& c, std::ostream* os) { *os << c.name; }

class LayerGrid : public testing::TestWithParam<LayerCase> {};

TEST_P(LayerGrid, ForwardAndGradientsMatchTheDenseOracle) {
  const LayerCase c = GetParam();
  LayerRun run(c, DType::kF32, 11);
  const double d_aux = 0.7, d_z = 1.3;
  const Oracle oracle = run.oracle(d_aux, d_z);
  const Params p = run.params();
  const Choices ch = oracle.decide(p);
  const Oracle::Result want = oracle.run(p, ch);

  const MoeLayerWorkspace ws = moe_layer_workspace(run.cfg, c.T, DType::kF32);
  ASSERT_GT(ws.saved_bytes, 0u);
  Bytes saved(ws.saved_bytes), fwd(ws.forward_bytes), bwd(ws.backward_bytes);
  float aux = -1, z = -1;
  HostTensor tpe(DType::kI32, {c.E});
  MoeLayerProfile prof;
  const Status s = moe_layer_forward(run.x.in(), run.weights(), run.cfg, saved, fwd,
                                     {run.out.mut(), &aux, &z, tpe.mut()}, &prof);
  ASSERT_TRUE(s.ok()) << s.message();
  for (int64_t i = 0; i < c.T * c.H; ++i) {
    ASSERT_NEAR(run.out.get_flat(i), want.out[i], 2e-5 * (1 + std::fabs(want.out[i]))) << i;
  }
  EXPECT_NEAR(aux, want.aux, 1e-5 * (1 + std::fabs(want.aux)));
  EXPECT_NEAR(z, want.z, 1e-5 * (1 + std::fabs(want.z)));
  for (int64_t e = 0; e < c.E; ++e) EXPECT_EQ(tpe.get({e}), ch.rows[e]) << "expert " << e;
  // Every step that ran has a time; the shared expert's is 0 exactly when there is none, and
  // dispatch and combine are the expert-parallel layer's alone.
  for (int i = 0; i < kMoeSteps; ++i) {
    const MoeStep step = static_cast<MoeStep>(i);
    const bool ran = (step != MoeStep::kSharedExpert || c.Fs > 0) && step != MoeStep::kDispatch &&
                     step != MoeStep::kCombine;
    EXPECT_EQ(prof.ms[i] > 0.0, ran) << moe_step_name(static_cast<MoeStep>(i));
  }

  Grads g(run, DType::kF32);
  const Status sb =
      moe_layer_backward(run.x.in(), run.weights(), run.cfg, saved, run.d_out.in(), d_aux, d_z, bwd,
                         g.d_x.mut(), g.views(c.Fs > 0, c.b_in, c.b_out));
  ASSERT_TRUE(sb.ok()) << sb.message();

  // Every gradient entry against central differences of the oracle's loss.
  struct Check {
    const char* name;
    Vec Params::*member;
    HostTensor* grad;
  };
  std::vector<Check> checks = {{"d_x", &Params::x, &g.d_x},
                               {"d_router", &Params::router, &g.router},
                               {"d_w_in", &Params::w_in, &g.w_in},
                               {"d_w_out", &Params::w_out, &g.w_out}};
  if (c.Fs > 0) {
    checks.push_back({"d_shared_in", &Params::shared_in, &g.shared_in});
    checks.push_back({"d_shared_out", &Params::shared_out, &g.shared_out});
  }
  if (c.b_in) checks.push_back({"d_b_in", &Params::b_in, &g.b_in});
  if (c.b_out) checks.push_back({"d_b_out", &Params::b_out, &g.b_out});
  for (const Check& k : checks) {
    Params q = p;
    Vec& v = q.*k.member;
    double worst = 0;
    for (size_t i = 0; i < v.size(); ++i) {
      const double keep = v[i], eps = 1e-6;
      v[i] = keep + eps;
      const double hi = oracle.run(q, ch).loss;
      v[i] = keep - eps;
      const double lo = oracle.run(q, ch).loss;
      v[i] = keep;
      const double fd = (hi - lo) / (2 * eps);
      const double got = k.grad->get_flat(static_cast<int64_t>(i));
      worst = std::max(worst, std::fabs(got - fd) / (1e-3 + std::fabs(fd)));
      ASSERT_NEAR(got, fd, 1e-4 + 1e-3 * std::fabs(fd)) << k.name << "[" << i << "]";
    }
    RecordProperty(k.name, fmt::format("{:.2e}", worst));
  }
}

std::vector<LayerCase> layer_grid() {
  std::vector<LayerCase> v;
  // Each preset's routing on small H and F (odd sizes), SwiGLU.
  v.push_back({.name = "mixtral", .T = 13, .H = 8, .F = 5, .E = 8, .k = 2});
  v.push_back({.name = "qwen3", .T = 9, .H = 6, .F = 3, .E = 16, .k = 8});
  v.push_back({.name = "deepseek_v2_lite",
               .T = 11,
               .H = 7,
               .F = 4,
               .E = 8,
               .k = 3,
               .Fs = 8,
               .pre_softmax = true,
               .aux_coeff = 1.0f,
               .z_coeff = 0.1f});
  v.push_back({.name = "deepseek_v3",
               .T = 12,
               .H = 8,
               .F = 5,
               .E = 16,
               .k = 4,
               .Fs = 5,
               .score = RouterScore::kSigmoid,
               .num_groups = 4,
               .group_topk = 2,
               .scale = 2.5f,
               .bias = true,
               .aux_coeff = 2.0f,
               .sequences = 3});
  v.push_back({.name = "gpt_oss", .T = 7, .H = 9, .F = 9, .E = 8, .k = 4, .z_coeff = 0.2f});
  v.push_back({.name = "olmoe",
               .T = 10,
               .H = 8,
               .F = 6,
               .E = 8,
               .k = 8,
               .pre_softmax = true,
               .aux_coeff = 1.0f});
  // The other scores and activations.
  v.push_back({.name = "sqrtsoftplus_geglu",
               .T = 9,
               .H = 5,
               .F = 7,
               .E = 6,
               .k = 2,
               .Fs = 3,
               .score = RouterScore::kSqrtSoftplus,
               .act = Activation::kGeGLU,
               .aux_coeff = 1.0f});
  v.push_back({.name = "sigmoid_gelu",
               .T = 8,
               .H = 6,
               .F = 5,
               .E = 4,
               .k = 1,
               .score = RouterScore::kSigmoid,
               .act = Activation::kGelu});
  v.push_back(
      {.name = "relu", .T = 6, .H = 5, .F = 4, .E = 4, .k = 2, .Fs = 2, .act = Activation::kRelu});
  // Capacity: the probs and position policies, padding to capacity, and alignment.
  v.push_back({.name = "capacity_probs",
               .T = 16,
               .H = 6,
               .F = 3,
               .E = 4,
               .k = 2,
               .capacity_factor = 0.6,
               .aux_coeff = 1.0f});
  v.push_back({.name = "capacity_position",
               .T = 16,
               .H = 6,
               .F = 3,
               .E = 4,
               .k = 2,
               .capacity_factor = 0.75,
               .policy = DropPolicy::kPosition});
  v.push_back({.name = "capacity_padded_aligned",
               .T = 10,
               .H = 4,
               .F = 3,
               .E = 4,
               .k = 2,
               .capacity_factor = 1.0,
               .pad_to_capacity = true,
               .align = 4});
  v.push_back({.name = "aligned", .T = 7, .H = 4, .F = 3, .E = 5, .k = 2, .align = 8});
  v.push_back({.name = "one_token", .T = 1, .H = 3, .F = 1, .E = 3, .k = 2, .Fs = 1});
  // The expert FFNs' biases (gpt-oss; MaxText's w0 / w1 / wo biases), together and each alone,
  // with padding rows of an alignment and of a capacity (they get the bias; unpermute never
  // reads them, and their gradient rows are 0), a shared expert (no bias) and the losses.
  v.push_back({.name = "gpt_oss_biases",
               .T = 9,
               .H = 7,
               .F = 5,
               .E = 8,
               .k = 4,
               .z_coeff = 0.2f,
               .b_in = true,
               .b_out = true});
  v.push_back({.name = "b_in_aligned_shared",
               .T = 7,
               .H = 5,
               .F = 4,
               .E = 5,
               .k = 2,
               .Fs = 3,
               .align = 4,
               .aux_coeff = 1.0f,
               .b_in = true});
  v.push_back({.name = "b_out_gelu_capacity_padded",
               .T = 12,
               .H = 6,
               .F = 3,
               .E = 4,
               .k = 2,
               .act = Activation::kGelu,
               .capacity_factor = 0.75,
               .pad_to_capacity = true,
               .b_out = true});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Layer, LayerGrid, testing::ValuesIn(layer_grid()),
                         [](const testing::TestParamInfo<LayerCase>& i) { return i.param.name; });

// Runs the forward (and, with grads, the backward) of a layer; returns the forward's status.
Status forward_backward(LayerRun& run, Grads* grads = nullptr) {
  const MoeLayerWorkspace ws = moe_layer_workspace(run.cfg, run.c.T, run.dt);
  Bytes saved(ws.saved_bytes), fwd(ws.forward_bytes), bwd(ws.backward_bytes);
  MOEKIT_RETURN_IF_ERROR(
      moe_layer_forward(run.x.in(), run.weights(), run.cfg, saved, fwd, {run.out.mut()}));
  if (!grads) return {};
  return moe_layer_backward(run.x.in(), run.weights(), run.cfg, saved, run.d_out.in(), 0, 0, bwd,
                            grads->d_x.mut(), grads->views(run.c.Fs > 0, run.c.b_in, run.c.b_out));
}

TEST(Layer, Bf16FollowsTheF32Layer) {
  const LayerCase c{.name = "bf16", .T = 33, .H = 64, .F = 48, .E = 8, .k = 2, .Fs = 32};
  LayerRun f32(c, DType::kF32, 5), bf16(c, DType::kBF16, 5);
  Grads g32(f32, DType::kF32), g16(bf16, DType::kBF16);
  ASSERT_TRUE(forward_backward(f32, &g32).ok());
  const Status s = forward_backward(bf16, &g16);
  ASSERT_TRUE(s.ok()) << s.message();
  // Same inputs (bf16-exact), so the difference is bf16 rounding of the intermediates.
  auto close = [](const HostTensor& a, const HostTensor& b, const char* what) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < static_cast<int64_t>(a.bytes.size() / dtype_size(a.dtype)); ++i) {
      num += std::pow(a.get_flat(i) - b.get_flat(i), 2);
      den += std::pow(a.get_flat(i), 2);
    }
    EXPECT_LT(std::sqrt(num / den), 0.02) << what;
  };
  close(f32.out, bf16.out, "out");
  close(g32.d_x, g16.d_x, "d_x");
  close(g32.w_in, g16.w_in, "d_w_in");
  close(g32.w_out, g16.w_out, "d_w_out");
  close(g32.router, g16.router, "d_router");
  close(g32.shared_in, g16.shared_in, "d_shared_in");
  // f32 gradients of the bf16 layer: d_x then takes the f32 sum directly, not the scratch.
  Grads g16f(bf16, DType::kF32);
  ASSERT_TRUE(forward_backward(bf16, &g16f).ok());
  close(g32.d_x, g16f.d_x, "d_x (f32)");
  close(g32.w_in, g16f.w_in, "d_w_in (f32)");
  close(g32.router, g16f.router, "d_router (f32)");
  close(g32.shared_out, g16f.shared_out, "d_shared_out (f32)");
}

// The weight-layout tests' cases: a shared expert and biases, odd sizes with a capacity and an
// alignment, and (a zero router) every token on one expert, the others empty.
std::vector<LayerCase> layout_cases() {
  return {{.name = "gated_shared_biases",
           .T = 67,
           .H = 64,
           .F = 48,
           .E = 8,
           .k = 2,
           .Fs = 32,
           .aux_coeff = 1.0f,
           .b_in = true,
           .b_out = true},
          {.name = "gelu_capacity_aligned_odd",
           .T = 40,
           .H = 25,
           .F = 19,
           .E = 4,
           .k = 2,
           .act = Activation::kGelu,
           .capacity_factor = 1.0,
           .align = 4},
          {.name = "one_group", .T = 45, .H = 40, .F = 33, .E = 4, .k = 1}};
}

// config.expert_weights_transposed: the layer on the same values with its experts' weights
// stored [E, out, in], read as they lie, against the default layout (whose results the grid
// checks against the oracle). The layouts take different kernels (on the CPU at bf16 and 8 rows
// an expert or more, AMX's two forms), so they agree to the sums' order: f32 to 1e-5 of the RMS,
// bf16 to 1% (each result rounded to bf16 once, and a rounding's difference carried on). The
// weight gradients come back in their weights' layouts. One case sends every token to one expert
// (a zero router), leaving the others empty.
TEST(Layer, ExpertWeightsTransposedComputeTheSameLayer) {
  const std::vector<LayerCase> cases = layout_cases();
  for (const DType dt : {DType::kF32, DType::kBF16}) {
    for (const LayerCase& c : cases) {
      SCOPED_TRACE(fmt::format("{} {}", c.name, dtype_name(dt)));
      LayerRun ref(c, dt, 7), run(c, dt, 7);
      if (c.name == "one_group") ref.router.fill(0.0f), run.router.fill(0.0f);
      run.transpose_expert_weights();
      Grads g_ref(ref, dt), g(run, dt);
      ASSERT_EQ(g.w_in.shape, (std::vector<int64_t>{c.E, ref.w_in.shape[2], c.H}));
      ASSERT_TRUE(forward_backward(ref, &g_ref).ok());
      const Status s = forward_backward(run, &g);
      ASSERT_TRUE(s.ok()) << s.message();
      const double tol = dt == DType::kF32 ? 1e-5 : 1e-2;
      auto close = [&](const HostTensor& want, const HostTensor& got, const char* what) {
        const int64_t n = static_cast<int64_t>(want.bytes.size() / dtype_size(want.dtype));
        double num = 0, den = 0;
        for (int64_t i = 0; i < n; ++i) {
          num += std::pow(want.get_flat(i) - got.get_flat(i), 2);
          den += std::pow(want.get_flat(i), 2);
        }
        if (den == 0.0) {  // (the router's gradient with one expert a token: 0 in both)
          EXPECT_EQ(num, 0.0) << what;
        } else {
          EXPECT_LE(std::sqrt(num / den), tol) << what;
        }
      };
      close(ref.out, run.out, "out");
      close(g_ref.d_x, g.d_x, "d_x");
      close(g_ref.router, g.router, "d_router");
      close(g_ref.w_in, transposed_matrices(g.w_in), "d_w_in");
      close(g_ref.w_out, transposed_matrices(g.w_out), "d_w_out");
      if (c.Fs > 0) close(g_ref.shared_in, g.shared_in, "d_shared_in");
      if (c.b_in) close(g_ref.b_in, g.b_in, "d_b_in");
      if (c.b_out) close(g_ref.b_out, g.b_out, "d_b_out");
    }
  }
}

// Every case in every dtype.
std::vector<std::pair<LayerCase, DType>> cases_by_dtype(const std::vector<LayerCase>& cases,
                                                        std::initializer_list<DType> dtypes) {
  std::vector<std::pair<LayerCase, DType>> all;
  for (DType dt : dtypes) {
    for (const LayerCase& c : cases) all.emplace_back(c, dt);
  }
  return all;
}

// config.expert_weights_packed: the forward on the same bf16 (f32) values with the experts'
// weights packed (pack_ragged_rhs) against the default layout's (which the grid checks against
// the oracle), to the bf16 results' rounding (f32's summation order); the backward refuses it, as
// do the wrong shapes, f32's packing in a bf16 layer, and expert_weights_transposed beside it.
TEST(Layer, ExpertWeightsPackedComputeTheSameForward) {
  const std::vector<LayerCase> cases = layout_cases();
  auto pack = [](const HostTensor& w) {
    const PackedRhsShape s = packed_rhs_shape(w.shape[0], w.shape[1], w.shape[2], w.dtype);
    HostTensor p(w.dtype, {s.dims[0], s.dims[1], s.dims[2]});
    HostTensor src = w;
    EXPECT_TRUE(pack_ragged_rhs(src.in(), p.mut()).ok());
    return p;
  };
  for (const auto& [c, dt] : cases_by_dtype(cases, {DType::kBF16, DType::kF32})) {
    SCOPED_TRACE(fmt::format("{} {}", c.name, dtype_name(dt)));
    LayerRun ref(c, dt, 7), run(c, dt, 7);
    if (c.name == "one_group") ref.router.fill(0.0f), run.router.fill(0.0f);
    run.w_in = pack(run.w_in);
    run.w_out = pack(run.w_out);
    run.cfg.expert_weights_packed = true;
    ASSERT_TRUE(forward_backward(ref).ok());
    const Status s = forward_backward(run);
    ASSERT_TRUE(s.ok()) << s.message();
    double num = 0, den = 0;
    for (int64_t i = 0; i < c.T * c.H; ++i) {
      num += std::pow(ref.out.get_flat(i) - run.out.get_flat(i), 2);
      den += std::pow(ref.out.get_flat(i), 2);
    }
    EXPECT_GT(den, 0.0);
    EXPECT_LE(std::sqrt(num / den), dt == DType::kBF16 ? 1e-2 : 1e-5);
    // The backward refuses packed weights, naming the field.
    Grads g(run, dt);
    const Status b = forward_backward(run, &g);
    EXPECT_FALSE(b.ok());
    EXPECT_NE(b.message().find("config.expert_weights_packed"), std::string::npos) << b.message();
  }
  // Refused: expert_weights_transposed beside it, f32 weights packed where the layer is bf16,
  // weights packed for another shape, and weights not packed at all.
  const LayerCase c = cases[0];
  LayerRun run(c, DType::kBF16, 7);
  const HostTensor w_in = run.w_in, w_out = run.w_out;
  run.w_in = pack(w_in);
  run.w_out = pack(w_out);
  run.cfg.expert_weights_packed = true;
  auto refused = [&](LayerRun& r, const char* names) {
    const Status s = forward_backward(r);
    EXPECT_FALSE(s.ok()) << names;
    EXPECT_NE(s.message().find(names), std::string::npos) << s.message();
  };
  run.cfg.expert_weights_transposed = true;
  refused(run, "config.expert_weights_transposed");
  run.cfg.expert_weights_transposed = false;
  LayerRun f32(c, DType::kF32, 7);
  run.w_in = pack(f32.w_in);
  refused(run, "weights.w_in");
  run.w_in = pack(w_in);
  run.w_out = pack(w_in);  // w_in's packing where w_out's belongs
  refused(run, "weights.w_out");
  run.w_out = pack(w_out);
  run.w_in = w_in;  // unpacked
  refused(run, "weights.w_in");
}

TEST(Activation, ReluHasNoGradientAtZeroAndEveryActivationMapsZeroToZero) {
  for (Activation act : kActivations) {
    const int64_t W = is_gated(act) ? 6 : 3;
    HostTensor h(DType::kF32, {2, W}), d_a(DType::kF32, {2, 3}), a(DType::kF32, {2, 3}),
        d_h(DType::kF32, {2, W});
    h.fill(0.0f);
    d_a.fill(1.0f);
    a.fill(9.0f);
    for (ActivationImpl impl : {ActivationImpl::kVectorized, ActivationImpl::kReference}) {
      ASSERT_TRUE(activation(h.in(), act, a.mut(), impl).ok());
      ASSERT_TRUE(activation_backward(h.in(), d_a.in(), act, d_h.mut(), impl).ok());
      for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(a.get_flat(i), 0.0) << act_name(act);
      // relu'(0) = 0; gelu'(0) = silu'(0) = 1/2; the gated ones' up gradient is act(0) = 0 and
      // their gate gradient is multiplied by up = 0.
      const double want = act == Activation::kRelu ? 0.0 : is_gated(act) ? 0.0 : 0.5;
      for (int64_t i = 0; i < 2 * W; ++i) EXPECT_EQ(d_h.get_flat(i), want) << act_name(act) << i;
    }
  }
}

TEST(Layer, EveryTokenOnOneExpertLeavesTheOthersEmpty) {
  // A zero router gives equal logits: every token's top-1 is expert 0 (ties: lower index), and
  // experts 1..E-1 get no rows. Their weight gradients, and their biases', are exactly 0; expert
  // 0's bias gradients are the column sums of d_out (b_out) and of d_h (b_in, not 0).
  const LayerCase c{
      .name = "one_group", .T = 9, .H = 5, .F = 3, .E = 4, .k = 1, .b_in = true, .b_out = true};
  LayerRun run(c, DType::kF32, 3);
  run.router.fill(0.0f);
  Grads g(run, DType::kF32);
  g.w_in.fill(7.0f);
  g.b_in.fill(7.0f);
  g.b_out.fill(7.0f);
  ASSERT_TRUE(forward_backward(run, &g).ok());
  for (int64_t j = 0; j < c.H; ++j) {  // one expert, weight 1 (k = 1): d_y = d_out
    double sum = 0;
    for (int64_t t = 0; t < c.T; ++t) sum += run.d_out.get({t, j});
    EXPECT_NEAR(g.b_out.get({0, j}), sum, 1e-5) << j;
  }
  for (int64_t e = 1; e < c.E; ++e) {
    for (int64_t j = 0; j < c.H; ++j) ASSERT_EQ(g.b_out.get({e, j}), 0.0) << e;
    for (int64_t j = 0; j < 2 * c.F; ++j) ASSERT_EQ(g.b_in.get({e, j}), 0.0) << e;
  }
  double b_in_used = 0;
  for (int64_t j = 0; j < 2 * c.F; ++j) b_in_used += std::fabs(g.b_in.get({0, j}));
  EXPECT_GT(b_in_used, 0.0);
  const Oracle oracle = run.oracle(0, 0);
  const Params p = run.params();
  const Choices ch = oracle.decide(p);
  const Vec want = oracle.run(p, ch).out;
  for (int64_t i = 0; i < c.T * c.H; ++i) ASSERT_NEAR(run.out.get_flat(i), want[i], 1e-5) << i;
  const int64_t per_expert = c.H * 2 * c.F;
  double used = 0;
  for (int64_t i = 0; i < per_expert; ++i) used += std::fabs(g.w_in.get_flat(i));
  EXPECT_GT(used, 0.0);
  for (int64_t i = per_expert; i < c.E * per_expert; ++i) ASSERT_EQ(g.w_in.get_flat(i), 0.0) << i;
}

TEST(Layer, NoTokens) {
  const LayerCase c{.name = "empty",
                    .T = 0,
                    .H = 4,
                    .F = 3,
                    .E = 4,
                    .k = 2,
                    .Fs = 2,
                    .aux_coeff = 0.1f,
                    .z_coeff = 0.1f,
                    .b_in = true,
                    .b_out = true};
  LayerRun run(c, DType::kF32, 1);
  Grads g(run, DType::kF32);
  g.w_in.fill(7.0f);
  g.router.fill(7.0f);
  g.shared_in.fill(7.0f);
  g.b_in.fill(7.0f);
  g.b_out.fill(7.0f);
  const Status s = forward_backward(run, &g);
  ASSERT_TRUE(s.ok()) << s.message();
  // The losses of no tokens are 0, and no weight gets gradient.
  const MoeLayerWorkspace ws = moe_layer_workspace(run.cfg, 0, DType::kF32);
  Bytes saved(ws.saved_bytes), fwd(ws.forward_bytes);
  float aux = -1, z = -1;
  ASSERT_TRUE(
      moe_layer_forward(run.x.in(), run.weights(), run.cfg, saved, fwd, {run.out.mut(), &aux, &z})
          .ok());
  EXPECT_EQ(aux, 0.0f);
  EXPECT_EQ(z, 0.0f);
  for (const HostTensor* t : {&g.router, &g.shared_in, &g.b_in, &g.b_out}) {
    for (int64_t i = 0; i < static_cast<int64_t>(t->bytes.size() / 4); ++i) {
      ASSERT_EQ(t->get_flat(i), 0.0);
    }
  }
  for (int64_t i = 0; i < static_cast<int64_t>(g.w_in.bytes.size() / 4); ++i) {
    ASSERT_EQ(g.w_in.get_flat(i), 0.0);
  }
}

// The batch-invariant mode: a probe token's output and d_x rows are the same bits at T = 1, 7,
// 64 and 4096, at any place among the other tokens, on 1 to 3 threads. With the losses on, the
// output still is (their gradients depend on the batch by definition, so d_x is compared
// without them).
struct InvariantCase {
  std::string name;
  DType dt;
  LayerCase layer;
};

void PrintTo(const InvariantCase& c, std::ostream* os) { *os << c.name; }

class LayerBatchInvariant : public testing::TestWithParam<InvariantCase> {};

TEST_P(LayerBatchInvariant, ATokenIsTheSameBitsInAnyBatch) {
  const InvariantCase& ic = GetParam();
  const bool losses = ic.layer.aux_coeff != 0 || ic.layer.z_coeff != 0;
  LayerRun probe(ic.layer, ic.dt, 17);  // T = 1: the probe token, the weights, d_out
  probe.cfg.batch_invariant = true;
  const size_t row_bytes = ic.layer.H * dtype_size(ic.dt);
  const int threads = omp_get_max_threads();
  std::vector<std::byte> want_out, want_dx;
  struct Place {
    int64_t T, at;
    int threads;
  };
  for (const Place& p : {Place{1, 0, 1}, Place{7, 3, 2}, Place{64, 63, 3}, Place{4096, 0, 2},
                         Place{4096, 2777, 1}, Place{1, 0, 2}}) {
    LayerCase c = ic.layer;
    c.T = p.T;
    LayerRun run(c, ic.dt, 100 + p.T);  // other tokens
    run.cfg.batch_invariant = true;
    for (auto [to, from] : {std::pair{&run.router, &probe.router},
                            {&run.w_in, &probe.w_in},
                            {&run.w_out, &probe.w_out},
                            {&run.shared_in, &probe.shared_in},
                            {&run.shared_out, &probe.shared_out}}) {
      to->bytes = from->bytes;
    }
    run.cfg.route.expert_bias = probe.cfg.route.expert_bias;
    std::memcpy(run.x.bytes.data() + p.at * row_bytes, probe.x.bytes.data(), row_bytes);
    std::memcpy(run.d_out.bytes.data() + p.at * row_bytes, probe.d_out.bytes.data(), row_bytes);
    Grads g(run, ic.dt);
    omp_set_num_threads(p.threads);
    const Status st = forward_backward(run, losses ? nullptr : &g);
    omp_set_num_threads(threads);
    ASSERT_TRUE(st.ok()) << st.message();
    const auto* out = run.out.bytes.data() + p.at * row_bytes;
    const auto* dx = g.d_x.bytes.data() + p.at * row_bytes;
    if (want_out.empty()) {
      want_out.assign(out, out + row_bytes);
      want_dx.assign(dx, dx + row_bytes);
    }
    EXPECT_TRUE(std::equal(out, out + row_bytes, want_out.begin()))
        << "out differs at T = " << p.T << ", token " << p.at << ", " << p.threads << " threads";
    if (!losses) {
      EXPECT_TRUE(std::equal(dx, dx + row_bytes, want_dx.begin()))
          << "d_x differs at T = " << p.T << ", token " << p.at << ", " << p.threads << " threads";
    }
  }
}

std::vector<InvariantCase> invariant_cases() {
  // Sizes at which the default mode's rows differ in bf16 too (at H = 64 the rounding hid it).
  const LayerCase base{.name = "", .T = 1, .H = 384, .F = 160, .E = 8, .k = 2};
  LayerCase shared = base;
  shared.Fs = 40;
  LayerCase grouped = base;  // DeepSeek-style: sigmoid scores, groups, a bias, scaled
  grouped.E = 16, grouped.k = 4, grouped.score = RouterScore::kSigmoid, grouped.num_groups = 4;
  grouped.group_topk = 2, grouped.bias = true, grouped.scale = 2.5f, grouped.Fs = 24;
  grouped.act = Activation::kGelu;
  LayerCase with_losses = base;
  with_losses.aux_coeff = 0.01f, with_losses.z_coeff = 0.001f;
  std::vector<InvariantCase> out;
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const std::string t = dt == DType::kF32 ? "f32" : "bf16";
    out.push_back({t + "_plain", dt, base});
    out.push_back({t + "_shared_expert", dt, shared});
    out.push_back({t + "_sigmoid_groups_bias_gelu", dt, grouped});
    out.push_back({t + "_losses_forward", dt, with_losses});
  }
  // bf16 rounds most differences away at the sizes above; at qwen3's hidden size the default
  // mode's token differs (here between 1 and 2 threads at T = 1).
  LayerCase wide = base;
  wide.H = 2048, wide.F = 256;
  out.push_back({"bf16_hidden2048", DType::kBF16, wide});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases, LayerBatchInvariant, testing::ValuesIn(invariant_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(LayerErrors, NamedBeforeAnythingIsWritten) {
  const LayerCase c{.name = "errors", .T = 5, .H = 4, .F = 3, .E = 4, .k = 2};
  auto expect = [&](const char* what, auto mutate, const std::string& argument) {
    LayerRun run(c, DType::kF32, 1);
    run.out.fill(9.0f);
    mutate(run);
    const MoeLayerWorkspace ws = moe_layer_workspace(run.cfg, c.T, DType::kF32);
    Bytes saved(std::max<size_t>(ws.saved_bytes, 64)), fwd(std::max<size_t>(ws.forward_bytes, 64));
    const Status s =
        moe_layer_forward(run.x.in(), run.weights(), run.cfg, saved, fwd, {run.out.mut()});
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << what;
    EXPECT_EQ(s.argument(), argument) << what << ": " << s.message();
    EXPECT_EQ(run.out.get_flat(0), 9.0) << what;
  };
  expect(
      "k > E", [](LayerRun& r) { r.cfg.route.k = 5; }, "k");
  expect(
      "E = 0", [](LayerRun& r) { r.cfg.num_experts = 0; }, "config.num_experts");
  expect(
      "x width", [](LayerRun& r) { r.cfg.hidden = 5; }, "x.shape");
  expect(
      "w_in not gated",
      [](LayerRun& r) {
        r.w_in = HostTensor(DType::kF32, {4, 4, 3});
      },
      "weights.w_in.shape");
  expect(
      "w_in [E, H, 2F] where the config says [E, 2F, H]",
      [](LayerRun& r) { r.cfg.expert_weights_transposed = true; }, "weights.w_in.shape");
  expect(
      "w_out [E, F, H] where the config says [E, H, F]",
      [](LayerRun& r) {
        r.w_in = transposed_matrices(r.w_in);
        r.cfg.expert_weights_transposed = true;
      },
      "weights.w_out.shape");
  expect(
      "w_out dtype",
      [](LayerRun& r) {
        r.w_out = HostTensor(DType::kBF16, {4, 3, 4});
      },
      "weights.w_out.dtype");
  expect(
      "shared without config",
      [](LayerRun& r) {
        r.c.Fs = 2;  // weights() now passes shared weights, config says none
        r.shared_in = HostTensor(DType::kF32, {4, 4});
        r.shared_out = HostTensor(DType::kF32, {2, 4});
      },
      "weights.shared_in");
  expect(
      "sequences", [](LayerRun& r) { r.cfg.aux_loss_sequences = 2; }, "config.aux_loss_sequences");
  expect(
      "capacity", [](LayerRun& r) { r.cfg.capacity_factor = -1; }, "capacity_factor");
  expect(
      "NaN coeff", [](LayerRun& r) { r.cfg.z_loss_coeff = NAN; }, "config.z_loss_coeff");
  expect(
      "b_in as wide as F, not 2F",
      [](LayerRun& r) {
        r.c.b_in = true;
        r.b_in = HostTensor(DType::kF32, {4, 3});
      },
      "weights.b_in.shape");
  expect(
      "b_out dtype",
      [](LayerRun& r) {
        r.c.b_out = true;
        r.b_out = HostTensor(DType::kBF16, {4, 4});
      },
      "weights.b_out.dtype");

  // Workspace too small, and misaligned.
  LayerRun run(c, DType::kF32, 1);
  run.out.fill(9.0f);
  const MoeLayerWorkspace ws = moe_layer_workspace(run.cfg, c.T, DType::kF32);
  Bytes saved(ws.saved_bytes + 64), fwd(ws.forward_bytes);
  Status s = moe_layer_forward(run.x.in(), run.weights(), run.cfg,
                               std::span(saved).first(ws.saved_bytes - 1), fwd, {run.out.mut()});
  EXPECT_EQ(s.argument(), "saved.size()") << s.message();
  s = moe_layer_forward(run.x.in(), run.weights(), run.cfg, std::span(saved).subspan(8), fwd,
                        {run.out.mut()});
  EXPECT_EQ(s.argument(), "saved.data()") << s.message();
  EXPECT_EQ(run.out.get_flat(0), 9.0);
  // The backward's own arguments.
  Grads g(run, DType::kF32);
  ASSERT_TRUE(moe_layer_forward(run.x.in(), run.weights(), run.cfg,
                                std::span(saved).first(ws.saved_bytes), fwd, {run.out.mut()})
                  .ok());
  Bytes bwd(ws.backward_bytes);
  HostTensor bad(DType::kF32, {4, 5});
  MoeLayerWeightGrads gv = g.views(false);
  gv.router = bad.mut();
  s = moe_layer_backward(run.x.in(), run.weights(), run.cfg, std::span(saved).first(ws.saved_bytes),
                         run.d_out.in(), 0, 0, bwd, g.d_x.mut(), gv);
  EXPECT_EQ(s.argument(), "grads.router.shape") << s.message();
  HostTensor d_out16(DType::kBF16, {c.T, c.H});
  s = moe_layer_backward(run.x.in(), run.weights(), run.cfg, std::span(saved).first(ws.saved_bytes),
                         d_out16.in(), 0, 0, bwd, g.d_x.mut(), g.views(false));
  EXPECT_EQ(s.argument(), "d_out.dtype") << s.message();
  // A bias gradient where the weights have no bias, and none where they have one.
  s = moe_layer_backward(run.x.in(), run.weights(), run.cfg, std::span(saved).first(ws.saved_bytes),
                         run.d_out.in(), 0, 0, bwd, g.d_x.mut(), g.views(false, true));
  EXPECT_EQ(s.argument(), "grads.b_in") << s.message();
  run.c.b_out = true;
  ASSERT_TRUE(moe_layer_forward(run.x.in(), run.weights(), run.cfg,
                                std::span(saved).first(ws.saved_bytes), fwd, {run.out.mut()})
                  .ok());
  s = moe_layer_backward(run.x.in(), run.weights(), run.cfg, std::span(saved).first(ws.saved_bytes),
                         run.d_out.in(), 0, 0, bwd, g.d_x.mut(), g.views(false));
  EXPECT_EQ(s.argument(), "grads.b_out") << s.message();
  EXPECT_EQ(moe_layer_workspace(MoeLayerConfig{}, 5, DType::kF32).saved_bytes, 0u);
  EXPECT_EQ(moe_layer_rows(run.cfg, 5), c.T * c.k);
}

}  // namespace
}  // namespace moekit

// The names the errors give each implementation; "unknown" past the enum.
TEST(Activation, ImplNames) {
  EXPECT_STREQ(impl_name(moekit::ActivationImpl::kAuto), "auto");
  EXPECT_STREQ(impl_name(moekit::ActivationImpl::kCuda), "cuda");
  EXPECT_STREQ(impl_name(moekit::ActivationImpl::kVectorized), "vectorized");
  EXPECT_STREQ(impl_name(moekit::ActivationImpl::kReference), "reference");
  EXPECT_STREQ(impl_name(static_cast<moekit::ActivationImpl>(9)), "unknown");
}
