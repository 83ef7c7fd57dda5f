// A seeded property test of the public ops (issue 22, item 6): random shapes, group sizes,
// offsets, strides, dtypes and options. A valid case must give what the scalar reference gives;
// a case made invalid by one random mutation must be refused with an error naming the op, with
// every output buffer untouched. Each family runs for a bounded time (MOEKIT_FUZZ_SECONDS, 5 by
// default; CI runs it under ASan and UBSan too, where an out-of-bounds access or an overflow is a
// failure of its own). A failure prints the seed of its case: MOEKIT_FUZZ_SEED=S reruns it.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "host_tensor.h"
#include "moekit/layer.h"
#include "moekit/permute.h"
#include "moekit/ragged_dot.h"
#include "moekit/router.h"

namespace moekit {
namespace {

using Rng = std::mt19937_64;

int64_t uniform(Rng& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}
bool coin(Rng& rng, double p = 0.5) { return std::bernoulli_distribution(p)(rng); }

// One case: returns "" when it holds, else what went wrong.
using Case = std::function<std::string(Rng& rng, bool invalid)>;

// Runs `one` on seeds base, base + 1, ... for the time budget (or only MOEKIT_FUZZ_SEED), a
// third of them mutated into invalid calls. Fails on the first case that does not hold.
void fuzz(const char* family, const Case& one) {
  const char* seconds_env = std::getenv("MOEKIT_FUZZ_SECONDS");
  const char* seed_env = std::getenv("MOEKIT_FUZZ_SEED");
  const double seconds = seconds_env ? std::atof(seconds_env) : 5.0;
  const auto start = std::chrono::steady_clock::now();
  const uint64_t base = std::hash<std::string>{}(family) % 1000000;
  int64_t cases = 0, invalid = 0;
  for (uint64_t seed = seed_env ? std::strtoull(seed_env, nullptr, 10) : base;; ++seed) {
    Rng rng(seed);
    const bool bad = coin(rng, 1.0 / 3);
    const std::string failure = one(rng, bad);
    ++cases;
    invalid += bad;
    ASSERT_EQ(failure, "") << family << ": MOEKIT_FUZZ_SEED=" << seed << " ("
                           << (bad ? "invalid" : "valid") << " case)";
    if (seed_env) break;
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    if (took.count() >= seconds) break;
  }
  std::printf("%s: %lld cases (%lld invalid) held\n", family, static_cast<long long>(cases),
              static_cast<long long>(invalid));
}

// The bytes of some tensors, to check that a refused call wrote none of them.
std::vector<std::vector<std::byte, Aligned64Allocator<std::byte>>> snapshot(
    std::initializer_list<const HostTensor*> ts) {
  std::vector<std::vector<std::byte, Aligned64Allocator<std::byte>>> s;
  for (const HostTensor* t : ts) s.push_back(t->bytes);
  return s;
}
bool unchanged(const std::vector<std::vector<std::byte, Aligned64Allocator<std::byte>>>& before,
               std::initializer_list<const HostTensor*> ts) {
  size_t i = 0;
  for (const HostTensor* t : ts) {
    if (t->bytes != before[i++]) return false;
  }
  return true;
}

// A refused call: an error that names the op, nothing written.
std::string refused(const Status& s, const char* op, bool untouched) {
  if (s.ok()) return fmt::format("{}: accepted an invalid call", op);
  if (s.message().find(op) == std::string::npos) {
    return fmt::format("{}: the error does not name the op: {}", op, s.message());
  }
  if (!untouched) return fmt::format("{}: wrote an output before refusing: {}", op, s.message());
  return "";
}

// Elements equal within tol * (1 + |want|), or both NaN.
std::string close(const HostTensor& got, const HostTensor& want, double tol, const char* what) {
  const int64_t n = static_cast<int64_t>(want.bytes.size() / dtype_size(want.dtype));
  for (int64_t i = 0; i < n; ++i) {
    const double a = got.get_flat(i), b = want.get_flat(i);
    if (a == b || (std::isnan(a) && std::isnan(b))) continue;  // infinities too
    if (!(std::fabs(a - b) <= tol * (1 + std::fabs(b)))) {
      return fmt::format("{}: element {} is {}, the reference's {}", what, i, a, b);
    }
  }
  return "";
}

DType float_dtype(Rng& rng) { return coin(rng) ? DType::kF32 : DType::kBF16; }

// ---------------------------------------------------------------------------------------------

std::string ragged_dot_case(Rng& rng, bool invalid) {
  const int64_t G = uniform(rng, 1, 6), E_loc = uniform(rng, 1, G), K = uniform(rng, 1, 9),
                n = uniform(rng, 1, 9);
  auto offset = static_cast<int32_t>(uniform(rng, 0, G - E_loc));
  std::vector<int32_t> sizes(G);
  if (coin(rng, 0.2)) {
    sizes[uniform(rng, 0, G - 1)] = static_cast<int32_t>(uniform(rng, 0, 12));  // one group
  } else {
    for (int32_t& s : sizes) s = static_cast<int32_t>(uniform(rng, 0, 5));
  }
  int64_t m = uniform(rng, 0, 3);
  for (int32_t s : sizes) m += s;
  const DType in = float_dtype(rng), out_t = coin(rng) ? DType::kF32 : in;
  const bool transposed = coin(rng);
  const int pass = static_cast<int>(uniform(rng, 0, 2));  // forward, dlhs, drhs
  RaggedDotOptions opt;
  opt.rhs_transposed = transposed;
  opt.accumulate = coin(rng, 0.25);
  opt.batch_invariant = coin(rng, 0.25);

  HostTensor lhs(in, {m, pass == 1 ? n : K}, uniform(rng, 0, 3));  // d_out for dlhs
  HostTensor rhs(
      in, transposed ? std::vector<int64_t>{E_loc, n, K} : std::vector<int64_t>{E_loc, K, n});
  HostTensor d_out(in, {m, n}, uniform(rng, 0, 2));
  const std::vector<int64_t> out_shape =
      pass == 0 ? std::vector<int64_t>{m, n}
      : pass == 1
          ? std::vector<int64_t>{m, K}
          : (transposed ? std::vector<int64_t>{E_loc, n, K} : std::vector<int64_t>{E_loc, K, n});
  HostTensor out(out_t, out_shape, pass == 2 ? 0 : uniform(rng, 0, 3));
  std::mt19937 fill(static_cast<uint32_t>(rng()));
  lhs.fill_random(fill), rhs.fill_random(fill), d_out.fill_random(fill), out.fill_random(fill);
  HostTensor ref = out;

  ConstTensorView a = lhs.in(), b = rhs.in(), c = d_out.in();
  TensorView o = out.mut();
  const char* op = pass == 0 ? "ragged_dot" : pass == 1 ? "ragged_dot_dlhs" : "ragged_dot_drhs";
  if (invalid) {
    switch (uniform(rng, 0, 7)) {
      case 0:
        sizes[uniform(rng, 0, G - 1)] = -static_cast<int32_t>(uniform(rng, 1, 3));
        break;
      case 1:
        sizes[0] += static_cast<int32_t>(m + 1);
        break;  // the sizes pass m
      case 2:
        offset = coin(rng) ? -1 : static_cast<int32_t>(G - E_loc + 1);
        break;
      case 3:
        a.stride[0] = a.shape[1] - 1;
        a.shape[0] = std::max<int64_t>(a.shape[0], 2);
        break;
      case 4:
        a.shape[0] = int64_t{1} << 40;
        break;  // far past the buffer and int32 rows
      case 5:
        o.dtype = DType::kI32;
        break;
      case 6:  // K or n disagree between the operands
        (pass == 2 ? o.shape[1] : b.shape[1]) += 1;
        break;
      case 7:  // the output on an input (overlapping only where both hold elements)
        if (m == 0) return "";
        if (pass == 2) {
          o.data = lhs.bytes.data();
        } else {
          a.data = out.bytes.data();
        }
        break;
    }
    const auto before = snapshot({&out, &lhs, &rhs, &d_out});
    const RaggedDotGroups groups{sizes, offset};
    const Status s = pass == 0   ? ragged_dot(a, b, groups, o, opt)
                     : pass == 1 ? ragged_dot_dlhs(a, b, groups, o, opt)
                                 : ragged_dot_drhs(a, c, groups, o, opt);
    return refused(s, op, unchanged(before, {&out, &lhs, &rhs, &d_out}));
  }
  RaggedDotOptions ref_opt = opt;
  ref_opt.impl = RaggedDotImpl::kReference;
  const auto call = [&](const RaggedDotOptions& op_opt, TensorView dst) {
    const RaggedDotGroups groups{sizes, offset};
    return pass == 0   ? ragged_dot(a, b, groups, dst, op_opt)
           : pass == 1 ? ragged_dot_dlhs(a, b, groups, dst, op_opt)
                       : ragged_dot_drhs(a, c, groups, dst, op_opt);
  };
  const Status got = call(opt, o), want = call(ref_opt, ref.mut());
  if (!got.ok() || !want.ok()) {
    return fmt::format("{}: a valid call failed: {} / {}", op, got.message(), want.message());
  }
  // bf16-exact inputs: products are exact; sums of at most 12 * 9 terms differ in order only.
  const double tol = out_t == DType::kF32 ? 1e-5 : 1.0 / 64;
  return close(out, ref, tol, op);
}

TEST(Fuzz, RaggedDotAgainstTheReference) { fuzz("ragged_dot", ragged_dot_case); }

// ---------------------------------------------------------------------------------------------

std::string permute_case(Rng& rng, bool invalid) {
  const int64_t T = uniform(rng, 0, 9), E = uniform(rng, 1, 6),
                k = uniform(rng, 1, std::min<int64_t>(E, 3)), H = uniform(rng, 1, 5);
  PermuteOptions o;
  o.align_size = uniform(rng, 1, 4);
  if (coin(rng, 0.4)) {
    o.capacity_factor = 0.25 * static_cast<double>(uniform(rng, 1, 8));
    o.pad_to_capacity = coin(rng, 0.3);
    o.drop_policy = coin(rng) ? DropPolicy::kProbs : DropPolicy::kPosition;
  }
  HostTensor topk(DType::kI32, {T, k});
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> experts(E);
    for (int32_t e = 0; e < E; ++e) experts[e] = e;
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int64_t s = 0; s < k; ++s) topk.set({t, s}, experts[s]);
  }
  const DType dt = float_dtype(rng);
  HostTensor x(dt, {T, H}, uniform(rng, 0, 2)), probs(DType::kF32, {T, k});
  std::mt19937 fill(static_cast<uint32_t>(rng()));
  x.fill_random(fill), probs.fill_random(fill);
  const int64_t N = permute_max_rows(T, E, static_cast<int32_t>(k), o) + uniform(rng, 0, 2);
  if (N < 0) return "permute_max_rows: -1 for valid options";
  struct Outs {
    HostTensor x, probs, tpe, row_map;
    Outs(DType dt, int64_t N, int64_t H, int64_t E, int64_t T, int64_t k)
        : x(dt, {N, H}),
          probs(DType::kF32, {N}),
          tpe(DType::kI32, {E}),
          row_map(DType::kI32, {2, T, k}) {
      x.fill(-7), probs.fill(-7), tpe.fill(-7), row_map.fill(-7);
    }
    PermuteOutputs views() { return {x.mut(), probs.mut(), tpe.mut(), row_map.mut(), {}}; }
  };
  Outs got(dt, N, H, E, T, k), want(dt, N, H, E, T, k);
  ConstTensorView xv = x.in(), tv = topk.in();
  PermuteOutputs ov = got.views();
  if (invalid) {
    switch (uniform(rng, 0, 5)) {
      case 0:
        if (T == 0) return "";
        topk.set({uniform(rng, 0, T - 1), uniform(rng, 0, k - 1)}, coin(rng) ? E : -1);
        break;
      case 1:
        o.align_size = coin(rng) ? 0 : int64_t{1} << 40;
        break;
      case 2:
        o.capacity_factor = coin(rng) ? -1.0 : NAN;
        break;
      case 3:
        ov.row_map.shape[1] += 1;
        break;
      case 4:  // too few rows for this routing
        if (T == 0) return "";
        o.capacity_factor = 0, o.pad_to_capacity = false;
        ov.x.shape[0] = ov.probs.shape[0] = T * k - 1;
        break;
      case 5:  // probs' rows on x's
        if (N == 0) return "";
        ov.probs.data = got.x.bytes.data();
        break;
    }
    const auto before = snapshot({&got.x, &got.probs, &got.tpe, &got.row_map, &x, &topk});
    const Status s = permute(xv, tv, probs.in(), o, ov);
    return refused(s, "permute",
                   unchanged(before, {&got.x, &got.probs, &got.tpe, &got.row_map, &x, &topk}));
  }
  PermuteOptions ref_o = o;
  ref_o.impl = PermuteImpl::kReference;
  const Status a = permute(xv, tv, probs.in(), o, ov),
               b = permute(xv, tv, probs.in(), ref_o, want.views());
  if (!a.ok() || !b.ok())
    return fmt::format("permute: a valid call failed: {} / {}", a.message(), b.message());
  for (auto [g, w, what] : {std::tuple{&got.x, &want.x, "x"},
                            {&got.probs, &want.probs, "probs"},
                            {&got.tpe, &want.tpe, "tokens_per_expert"},
                            {&got.row_map, &want.row_map, "row_map"}}) {
    if (g->bytes != w->bytes) return fmt::format("permute: {} differs from the reference's", what);
  }
  // And back: unpermute of the permuted rows with the weights, both implementations.
  HostTensor y(dt, {T, H}), y_ref(dt, {T, H});
  y.fill(-7), y_ref.fill(-7);
  const Status c = unpermute(got.x.in(), got.row_map.in(), probs.in(), y.mut());
  const Status d =
      unpermute(got.x.in(), got.row_map.in(), probs.in(), y_ref.mut(), PermuteImpl::kReference);
  if (!c.ok() || !d.ok())
    return fmt::format("unpermute: a valid call failed: {} / {}", c.message(), d.message());
  return close(y, y_ref, dt == DType::kF32 ? 1e-6 : 1.0 / 128, "unpermute");
}

TEST(Fuzz, PermuteAndUnpermuteAgainstTheReference) { fuzz("permute", permute_case); }

// ---------------------------------------------------------------------------------------------

std::string route_case(Rng& rng, bool invalid) {
  const int64_t T = uniform(rng, 0, 7);
  const int64_t E = std::vector<int64_t>{2, 4, 6, 8, 16, 32, 64, 96}[uniform(rng, 0, 7)];
  RouteOptions o;
  o.k = static_cast<int32_t>(uniform(rng, 1, std::min<int64_t>(E, 8)));
  o.score = std::vector<RouterScore>{RouterScore::kSoftmax, RouterScore::kSigmoid,
                                     RouterScore::kSqrtSoftplus}[uniform(rng, 0, 2)];
  o.pre_softmax = o.score == RouterScore::kSoftmax && coin(rng);
  o.scaling_factor = coin(rng) ? 1.0f : 2.5f;
  // Only choices the two implementations must make alike: group scores of one key each (a sum
  // of two can tie in exact arithmetic and round apart, as sigmoid(x) + sigmoid(-x) = 1 does),
  // and no bias (a score plus a bias can come within an ulp of another). test_router.cpp covers
  // those against an oracle that knows each decision's margin.
  const std::vector<float> bias;
  for (int32_t g : {8, 4, 2}) {
    if (E % g == 0 && o.k <= g && coin(rng, 0.3)) {
      o.num_groups = g, o.group_topk = o.k;
      break;
    }
  }
  // Logits on a grid of eighths (ties exact, other scores far apart), some NaN and infinite.
  const DType dt = float_dtype(rng);
  HostTensor logits(dt, {T, E}, uniform(rng, 0, 2));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r = uniform(rng, 0, 99);
      logits.set({t, e}, r == 0   ? NAN
                         : r == 1 ? -INFINITY
                         : r == 2 ? INFINITY
                                  : 0.125 * static_cast<double>(uniform(rng, -32, 32)));
    }
  }
  HostTensor idx(DType::kI32, {T, o.k}), w(DType::kF32, {T, o.k}), map(DType::kBool, {T, E});
  idx.fill(-7), w.fill(-7), map.fill(3);
  RouteOutputs out{{}, map.mut(), idx.mut(), w.mut()};
  if (invalid) {
    switch (uniform(rng, 0, 4)) {
      case 0:
        o.k = coin(rng) ? 0 : static_cast<int32_t>(E + 1);
        break;
      case 1:
        out.topk_indices.shape[1] += 1;
        break;
      case 2:
        o.scaling_factor = NAN;
        break;
      case 3:
        out.topk_weights.data = idx.bytes.data();
        break;  // on topk_indices
      case 4:
        o.num_groups = static_cast<int32_t>(E + 1), o.group_topk = 1;
        break;
    }
    if (T == 0 && out.topk_weights.data == idx.bytes.data()) return "";  // nothing overlaps
    const auto before = snapshot({&idx, &w, &map, &logits});
    const Status s = route(logits.in(), o, out);
    return refused(s, "route", unchanged(before, {&idx, &w, &map, &logits}));
  }
  HostTensor idx_r(DType::kI32, {T, o.k}), w_r(DType::kF32, {T, o.k}), map_r(DType::kBool, {T, E});
  idx_r.fill(-7), w_r.fill(-7), map_r.fill(3);
  RouteOptions ref = o;
  ref.impl = RouterImpl::kReference;
  const Status a = route(logits.in(), o, out),
               b = route(logits.in(), ref, {{}, map_r.mut(), idx_r.mut(), w_r.mut()});
  if (!a.ok() || !b.ok())
    return fmt::format("route: a valid call failed: {} / {}", a.message(), b.message());
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> x, got, want;
    for (int64_t e = 0; e < E; ++e) x.push_back(logits.get({t, e}));
    for (int32_t i = 0; i < o.k; ++i)
      got.push_back(idx.get({t, i})), want.push_back(idx_r.get({t, i}));
    if (got != want) {
      return fmt::format(
          "route (E {} k {} score {} pre {} groups {}/{} bias {} {}): row {} chose {}, the "
          "reference {}; logits {}",
          E, o.k, static_cast<int>(o.score), o.pre_softmax, o.num_groups, o.group_topk,
          !bias.empty(), dtype_name(dt), t, fmt::join(got, " "), fmt::join(want, " "),
          fmt::join(x, " "));
    }
  }
  if (map.bytes != map_r.bytes) return "route: routing_map differs from the reference's";
  return close(w, w_r, 2e-6, "route topk_weights");
}

TEST(Fuzz, RouteAgainstTheReference) { fuzz("route", route_case); }

// ---------------------------------------------------------------------------------------------

std::string activation_case(Rng& rng, bool invalid) {
  const Activation act =
      std::vector<Activation>{Activation::kSwiGLU, Activation::kGeGLU, Activation::kGelu,
                              Activation::kRelu}[uniform(rng, 0, 3)];
  const bool gated = act == Activation::kSwiGLU || act == Activation::kGeGLU;
  const int64_t N = uniform(rng, 0, 9), F = uniform(rng, 1, 40);
  const DType dt = float_dtype(rng), out_t = coin(rng) ? DType::kF32 : dt;
  const bool backward = coin(rng);
  HostTensor h(dt, {N, gated ? 2 * F : F}, uniform(rng, 0, 3)), d_a(dt, {N, F}, uniform(rng, 0, 2));
  HostTensor out(out_t, backward ? h.shape : std::vector<int64_t>{N, F}, uniform(rng, 0, 2));
  std::mt19937 fill(static_cast<uint32_t>(rng()));
  h.fill_random(fill), d_a.fill_random(fill), out.fill(-7);
  HostTensor ref = out;
  ConstTensorView hv = h.in();
  TensorView ov = out.mut();
  const char* op = backward ? "activation_backward" : "activation";
  const auto call = [&](TensorView dst, ActivationImpl impl) {
    return backward ? activation_backward(hv, d_a.in(), act, dst, impl)
                    : activation(hv, act, dst, impl);
  };
  if (invalid) {
    switch (uniform(rng, 0, 3)) {
      case 0:
        ov.shape[1] += 1;
        break;
      case 1:
        hv.stride[0] = hv.shape[1] - 1, hv.shape[0] = std::max<int64_t>(hv.shape[0], 2);
        break;
      case 2:
        ov.dtype = DType::kI32;
        break;
      case 3:
        if (N == 0) return "";
        ov.data = h.bytes.data(), ov.dtype = dt, ov.stride[0] = hv.stride[0];
        if (backward) ov.shape[1] = hv.shape[1];
        break;
    }
    const auto before = snapshot({&out, &h});
    return refused(call(ov, ActivationImpl::kAuto), op, unchanged(before, {&out, &h}));
  }
  const Status a = call(ov, ActivationImpl::kAuto), b = call(ref.mut(), ActivationImpl::kReference);
  if (!a.ok() || !b.ok())
    return fmt::format("{}: a valid call failed: {} / {}", op, a.message(), b.message());
  return close(out, ref, out_t == DType::kF32 ? 2e-6 : 1.0 / 128, op);
}

TEST(Fuzz, ActivationAgainstTheReference) { fuzz("activation", activation_case); }

}  // namespace
}  // namespace moekit
