// The router on CUDA buffers (router.h with Exec::device = kCuda) against the double-precision
// oracle of router_oracle.h, as the CPU tests check the CPU implementations, and against the
// CPU's own results for the losses, the counts and the bias update.
//
// Without a GPU (or built without CUDA) the tests that need one skip with a message; the
// host-side argument checks run anyway.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "host_tensor.h"
#include "moekit/router.h"
#include "router_oracle.h"

#if MOEKIT_HAS_CUDA
#include "device_tensor.h"
#endif

namespace moekit {
namespace {

using namespace router_oracle;  // NOLINT(google-build-using-namespace): the oracle is the test's

Exec cuda_exec_no_workspace() { return Exec{Device::kCuda, nullptr, nullptr, 0}; }

// --- Host-side checks: made before anything touches the device --------------------------------

TEST(RouterCudaHost, BadArgumentsAreNamedOnTheHost) {
  // Host memory posing as device memory: the calls must refuse before reading or launching.
  HostTensor logits(DType::kF32, {4, 8}), idx(DType::kI32, {4, 2}), w(DType::kF32, {4, 2});
  const Exec exec = cuda_exec_no_workspace();
  RouteOptions o;
  o.k = 9;
  Status s = route(logits.in(), o, {{}, {}, idx.mut(), w.mut()}, exec);
  if (!cuda_built()) {
    EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s.message();
    return;
  }
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_EQ(s.argument(), "k");
  o.k = 2;
  HostTensor bad_w(DType::kF32, {4, 3});
  s = route(logits.in(), o, {{}, {}, idx.mut(), bad_w.mut()}, exec);
  EXPECT_EQ(s.argument(), "topk_weights.shape") << s.message();
  HostTensor d_logits(DType::kI32, {4, 8});
  s = route_backward(logits.in(), idx.in(), {}, w.in(), o, d_logits.mut(), exec);
  EXPECT_EQ(s.argument(), "d_logits.dtype") << s.message();
  float loss = 0;
  HostTensor counts(DType::kI32, {7});
  s = load_balancing_loss(logits.in(), counts.in(), {}, &loss, exec);
  EXPECT_EQ(s.argument(), "tokens_per_expert.shape") << s.message();
  Exec bogus = exec;
  bogus.device = static_cast<Device>(7);
  s = z_loss(logits.in(), 1.0f, &loss, bogus);
  EXPECT_EQ(s.argument(), "exec.device") << s.message();
}

TEST(RouterCudaHost, WorkspaceSizes) {
  EXPECT_EQ(router_workspace_size(Device::kCpu, 100, 8), 0u);
  EXPECT_EQ(router_workspace_size(Device::kCuda, 0, 8), 0u);
  if (cuda_built()) EXPECT_GT(router_workspace_size(Device::kCuda, 100, 8), 0u);
}

#if MOEKIT_HAS_CUDA

// --- On the GPU ---------------------------------------------------------------------------------

struct CudaRouteCase {
  std::string name;
  RouterScore score;
  bool pre_softmax;
  int64_t E;
  int32_t k, groups, group_topk;
  bool bias;
  double scale;
  int64_t T;
  DType dtype;  // of the logits and the float outputs
};
void PrintTo(const CudaRouteCase& c, std::ostream* os) { *os << c.name; }

std::vector<CudaRouteCase> route_cases() {
  using S = RouterScore;
  const DType f = DType::kF32, b = DType::kBF16;
  return {
      {"post_E1_k1_T1", S::kSoftmax, false, 1, 1, 0, 0, false, 1.0, 1, f},
      {"post_E8_k2_T111", S::kSoftmax, false, 8, 2, 0, 0, false, 1.0, 111, f},
      {"post_E7_k7_T7", S::kSoftmax, false, 7, 7, 0, 0, false, 1.0, 7, f},
      {"post_E128_k8_T500_bf16", S::kSoftmax, false, 128, 8, 0, 0, false, 1.0, 500, b},
      {"post_E40_k40_T3", S::kSoftmax, false, 40, 40, 0, 0, false, 1.0, 3, f},
      {"pre_E64_k6_T111", S::kSoftmax, true, 64, 6, 0, 0, false, 1.0, 111, f},
      {"pre_E300_k8_T37", S::kSoftmax, true, 300, 8, 0, 0, false, 2.5, 37, f},
      {"sigmoid_E33_k3_T7", S::kSigmoid, false, 33, 3, 0, 0, false, 1.0, 7, f},
      {"sigmoid_dsv3_T500", S::kSigmoid, false, 256, 8, 8, 4, true, 2.5, 500, f},
      {"sigmoid_dsv3_T111_bf16", S::kSigmoid, false, 256, 8, 8, 4, true, 2.5, 111, b},
      {"sigmoid_E1024_k16_T17", S::kSigmoid, false, 1024, 16, 32, 4, true, 1.0, 17, f},
      {"sqrtsoftplus_E96_k4_T111", S::kSqrtSoftplus, false, 96, 4, 0, 0, true, 1.0, 111, f},
      {"sqrtsoftplus_E64_k1_T7", S::kSqrtSoftplus, false, 64, 1, 4, 1, false, 1.0, 7, f},
  };
}

Options oracle_options(const CudaRouteCase& c, std::mt19937& rng) {
  Options o = make_options(c.score, c.pre_softmax, c.k, c.groups, c.group_topk, c.scale);
  if (c.bias) {
    std::uniform_real_distribution<float> u(-0.1f, 0.1f);
    for (int64_t e = 0; e < c.E; ++e) o.bias.push_back(u(rng));
  }
  return o;
}

// Random logits, normal(0, 2) as stored in the case's dtype.
HostTensor make_logits(const CudaRouteCase& c, std::mt19937& rng) {
  HostTensor logits(c.dtype, {c.T, c.E});
  std::normal_distribution<float> normal(0.f, 2.f);
  for (int64_t i = 0; i < c.T * c.E; ++i) logits.set_flat(i, normal(rng));
  return logits;
}

// Rows whose choice is decided by the tie and NaN rules alone: every expert tied, one NaN, a
// +inf, every logit -inf, every third NaN.
HostTensor special_logits(const CudaRouteCase& c, std::mt19937& rng) {
  HostTensor logits(c.dtype, {5, c.E});
  std::normal_distribution<float> normal(0.f, 2.f);
  for (int64_t i = 0; i < 5 * c.E; ++i) logits.set_flat(i, normal(rng));
  const double nan = std::numeric_limits<double>::quiet_NaN(),
               inf = std::numeric_limits<double>::infinity();
  for (int64_t e = 0; e < c.E; ++e) logits.set({0, e}, 0.5);
  logits.set({1, c.E / 2}, nan);
  logits.set({2, 0}, inf);
  for (int64_t e = 0; e < c.E; ++e) logits.set({3, e}, -inf);
  for (int64_t e = 0; e < c.E; e += 3) logits.set({4, e}, nan);
  return logits;
}

// route on the device.
void route_on_device(HostTensor& logits, const RouteOptions& ro, HostTensor& probs, HostTensor& map,
                     HostTensor& idx, HostTensor& w) {
  probs.fill(NAN);
  map.fill(7);
  DeviceTensor dl(logits), dp(probs), dm(map), di(idx), dw(w);
  const Status s =
      route(dl.in(logits), ro, {dp.mut(probs), dm.mut(map), di.mut(idx), dw.mut(w)}, cuda_exec());
  ASSERT_TRUE(s.ok()) << s.message();
  CUDA_OK(cudaDeviceSynchronize());
  dp.download(probs), dm.download(map), di.download(idx), dw.download(w);
}

class RouteCuda : public ::testing::TestWithParam<CudaRouteCase> {};

// route on the device against the oracle (rows within 1e-6 of a different choice skipped, as on
// the CPU), then route_backward against the CPU's backward on the same chosen experts.
TEST_P(RouteCuda, ForwardMatchesTheOracleAndBackwardTheCpu) {
  MOEKIT_REQUIRE_GPU();
  const CudaRouteCase c = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(c.E * 31 + c.k * 7 + c.T));
  const Options o = oracle_options(c, rng);
  HostTensor logits = make_logits(c, rng);
  DeviceTensor d_logits_in(logits);
  DeviceTensor bias(o.bias.size() * sizeof(float));
  if (!o.bias.empty()) bias.upload(o.bias.data(), o.bias.size() * sizeof(float));
  RouteOptions ro = to_route_options(o, RouterImpl::kAuto);
  if (!o.bias.empty()) ro.expert_bias = {static_cast<const float*>(bias.ptr), o.bias.size()};

  HostTensor probs(c.dtype, {c.T, c.E}), map(DType::kBool, {c.T, c.E}),
      idx(DType::kI32, {c.T, c.k}), w(c.dtype, {c.T, c.k});
  route_on_device(logits, ro, probs, map, idx, w);
  if (HasFatalFailure()) return;
  // The oracle reads the logits as stored (bf16 values exactly); f32 math on both sides.
  const double tol = c.dtype == DType::kF32 ? 2e-6 : 8e-3;
  const int64_t skipped = expect_route_matches(logits, o, probs, map, idx, w, tol, true);
  EXPECT_LE(skipped, std::max<int64_t>(1, c.T / 100)) << "too many near-tied rows";

  // Ties, NaN and infinities: the choice and its order exactly the oracle's; NaN weights where
  // its are.
  HostTensor special = special_logits(c, rng), sp(c.dtype, {5, c.E}), sm(DType::kBool, {5, c.E}),
             si(DType::kI32, {5, c.k}), sw(c.dtype, {5, c.k});
  route_on_device(special, ro, sp, sm, si, sw);
  if (HasFatalFailure()) return;
  for (int64_t t = 0; t < 5; ++t) {
    const RowResult want = route_row(row_of(special, t), o);
    for (int32_t i = 0; i < c.k; ++i) {
      ASSERT_EQ(si.get({t, i}), want.idx[i]) << "special row " << t << " slot " << i;
      const double got = sw.get({t, i});
      if (std::isnan(want.w[i])) {
        EXPECT_TRUE(std::isnan(got)) << "special row " << t << " slot " << i;
      } else if (std::isinf(want.w[i])) {
        EXPECT_EQ(got, want.w[i]) << "special row " << t << " slot " << i;
      } else {
        EXPECT_NEAR(got, want.w[i], tol * (1 + std::fabs(want.w[i]))) << "special row " << t;
      }
    }
    int64_t ones = 0;
    for (int64_t e = 0; e < c.E; ++e) ones += sm.get({t, e}) != 0;
    EXPECT_EQ(ones, c.k) << "special row " << t;
  }

  // The backward, from the CPU's choice, against the CPU's backward (vectorised).
  HostTensor cpu_idx(DType::kI32, {c.T, c.k}), cpu_w(DType::kF32, {c.T, c.k});
  RouteOptions cpu_ro = to_route_options(o, RouterImpl::kAuto);
  ASSERT_TRUE(route(logits.in(), cpu_ro, {{}, {}, cpu_idx.mut(), cpu_w.mut()}).ok());
  HostTensor d_probs(DType::kF32, {c.T, c.E}), d_w(c.dtype, {c.T, c.k});
  d_probs.fill_random(rng);
  d_w.fill_random(rng);
  for (int cotangents = 1; cotangents <= 3; ++cotangents) {  // d_probs, d_w, both
    const bool with_p = cotangents & 1, with_w = cotangents & 2;
    HostTensor want(c.dtype, {c.T, c.E}), got(c.dtype, {c.T, c.E});
    ASSERT_TRUE(route_backward(logits.in(), cpu_idx.in(), with_p ? d_probs.in() : ConstTensorView{},
                               with_w ? d_w.in() : ConstTensorView{}, cpu_ro, want.mut())
                    .ok());
    got.fill(NAN);
    DeviceTensor g_idx(cpu_idx), g_dp(d_probs), g_dw(d_w), g_out(got);
    const Status b = route_backward(
        d_logits_in.in(logits), g_idx.in(cpu_idx), with_p ? g_dp.in(d_probs) : ConstTensorView{},
        with_w ? g_dw.in(d_w) : ConstTensorView{}, ro, g_out.mut(got), cuda_exec());
    ASSERT_TRUE(b.ok()) << b.message();
    CUDA_OK(cudaDeviceSynchronize());
    g_out.download(got);
    const double btol = c.dtype == DType::kF32 ? 1e-5 : 1e-2;
    for (int64_t t = 0; t < c.T; ++t) {
      for (int64_t e = 0; e < c.E; ++e) {
        const double g = got.get({t, e}), want_v = want.get({t, e});
        if (std::isnan(want_v)) {
          EXPECT_TRUE(std::isnan(g)) << "row " << t << " expert " << e;
          continue;
        }
        ASSERT_NEAR(g, want_v, btol * (1 + std::fabs(want_v)))
            << "cotangents " << cotangents << " row " << t << " expert " << e;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Gpu, RouteCuda, ::testing::ValuesIn(route_cases()),
                         [](const auto& info) { return info.param.name; });

// An index outside [0, E) in route_backward's topk_indices adds no gradient on the device (the
// host cannot check it): the call runs, the other rows match the CPU, the row stays finite.
TEST(RouteCuda, BackwardIgnoresIndicesOutOfRange) {
  MOEKIT_REQUIRE_GPU();
  const int64_t T = 9, E = 16;
  std::mt19937 rng(5);
  HostTensor logits(DType::kF32, {T, E}), idx(DType::kI32, {T, 2}), d_w(DType::kF32, {T, 2});
  logits.fill_random(rng);
  d_w.fill_random(rng);
  for (int64_t t = 0; t < T; ++t) idx.set({t, 0}, t % E), idx.set({t, 1}, (t + 3) % E);
  idx.set({4, 1}, -3);
  idx.set({6, 0}, E + 100);
  RouteOptions o;
  o.k = 2;
  o.score = RouterScore::kSigmoid;
  HostTensor want(DType::kF32, {T, E}), got(DType::kF32, {T, E});
  HostTensor clean = idx;
  clean.set({4, 1}, 0), clean.set({6, 0}, 1);
  ASSERT_TRUE(route_backward(logits.in(), clean.in(), {}, d_w.in(), o, want.mut()).ok());
  DeviceTensor gl(logits), gi(idx), gw(d_w), go(got);
  ASSERT_TRUE(
      route_backward(gl.in(logits), gi.in(idx), {}, gw.in(d_w), o, go.mut(got), cuda_exec()).ok());
  CUDA_OK(cudaDeviceSynchronize());
  go.download(got);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      if (t == 4 || t == 6) {
        EXPECT_TRUE(std::isfinite(got.get({t, e})));
      } else {
        EXPECT_NEAR(got.get({t, e}), want.get({t, e}), 1e-5) << t << ", " << e;
      }
    }
  }
}

TEST(RouteCuda, MoreThan1024ExpertsIsUnimplemented) {
  MOEKIT_REQUIRE_GPU();
  HostTensor logits(DType::kF32, {2, 1025}), idx(DType::kI32, {2, 1});
  DeviceTensor gl(logits), gi(idx);
  RouteOptions o;
  const Status s = route(gl.in(logits), o, {{}, {}, gi.mut(idx), {}}, cuda_exec());
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s.message();
}

// aux_loss_scores and its backward against the oracle and the CPU.
TEST(AuxScoresCuda, MatchTheOracleAndTheCpu) {
  MOEKIT_REQUIRE_GPU();
  for (RouterScore score :
       {RouterScore::kSoftmax, RouterScore::kSigmoid, RouterScore::kSqrtSoftplus}) {
    for (auto [T, E, k] :
         {std::tuple<int64_t, int64_t, int32_t>{111, 64, 6}, {7, 256, 8}, {1, 3, 1}}) {
      SCOPED_TRACE(testing::Message()
                   << "score " << static_cast<int>(score) << " T " << T << " E " << E);
      std::mt19937 rng(static_cast<uint32_t>(T + E));
      HostTensor logits(DType::kF32, {T, E}), scores(DType::kF32, {T, E}),
          map(DType::kBool, {T, E});
      std::normal_distribution<float> normal(0.f, 2.f);
      for (int64_t i = 0; i < T * E; ++i) logits.set_flat(i, normal(rng));
      DeviceTensor gl(logits), gs(scores), gm(map);
      ASSERT_TRUE(aux_loss_scores(gl.in(logits), k, score, gs.mut(scores), gm.mut(map),
                                  RouterImpl::kAuto, cuda_exec())
                      .ok());
      CUDA_OK(cudaDeviceSynchronize());
      gs.download(scores), gm.download(map);
      for (int64_t t = 0; t < T; ++t) {
        const Vec q = aux_scores_row(row_of(logits, t), score);
        const auto order = ranked(q, std::vector<bool>(E, true));
        const bool near_tie = gap(q, order, k) < 1e-6;
        std::vector<bool> chosen(E, false);
        for (int32_t i = 0; i < k; ++i) chosen[order[i]] = true;
        for (int64_t e = 0; e < E; ++e) {
          ASSERT_NEAR(scores.get({t, e}), q[e], 2e-6 * (1 + q[e])) << t << ", " << e;
          if (!near_tie) ASSERT_EQ(map.get({t, e}) != 0, chosen[e]) << t << ", " << e;
        }
      }
      HostTensor d_scores(DType::kF32, {T, E}), want(DType::kF32, {T, E}), got(DType::kF32, {T, E});
      d_scores.fill_random(rng);
      ASSERT_TRUE(aux_loss_scores_backward(logits.in(), d_scores.in(), score, want.mut()).ok());
      DeviceTensor gd(d_scores), go(got);
      ASSERT_TRUE(aux_loss_scores_backward(gl.in(logits), gd.in(d_scores), score, go.mut(got),
                                           RouterImpl::kAuto, cuda_exec())
                      .ok());
      CUDA_OK(cudaDeviceSynchronize());
      go.download(got);
      for (int64_t i = 0; i < T * E; ++i) {
        ASSERT_NEAR(got.get_flat(i), want.get_flat(i), 1e-5 * (1 + std::fabs(want.get_flat(i))))
            << i;
      }
    }
  }
}

// The losses, their gradients, the counts and the bias update against the CPU's.
TEST(LossesCuda, MatchTheCpu) {
  MOEKIT_REQUIRE_GPU();
  const int64_t T = 123, E = 64, B = 3;  // 41 tokens per sequence
  std::mt19937 rng(17);
  HostTensor logits(DType::kBF16, {T, E}), scores(DType::kF32, {T, E}), map(DType::kBool, {T, E});
  logits.fill_random(rng);
  ASSERT_TRUE(aux_loss_scores(logits.in(), 4, RouterScore::kSoftmax, scores.mut(), map.mut()).ok());
  DeviceTensor gl(logits), gs(scores), gm(map);
  DeviceTensor ws(router_workspace_size(Device::kCuda, T, E));
  const Exec exec = cuda_exec(&ws);

  // Counts, per batch and per sequence: exact.
  HostTensor counts(DType::kI32, {E}), seq_counts(DType::kI32, {B, E});
  ASSERT_TRUE(count_tokens_per_expert(map.in(), counts.mut()).ok());
  ASSERT_TRUE(count_tokens_per_expert(map.in(), seq_counts.mut()).ok());
  HostTensor got_counts(DType::kI32, {E}), got_seq(DType::kI32, {B, E}, /*row_pad=*/3);
  got_counts.fill(-1), got_seq.fill(-1);
  DeviceTensor gc(got_counts), gq(got_seq);
  ASSERT_TRUE(count_tokens_per_expert(gm.in(map), gc.mut(got_counts), exec).ok());
  ASSERT_TRUE(count_tokens_per_expert(gm.in(map), gq.mut(got_seq), exec).ok());
  CUDA_OK(cudaDeviceSynchronize());
  gc.download(got_counts), gq.download(got_seq);
  for (int64_t e = 0; e < E; ++e) {
    ASSERT_EQ(got_counts.get({e}), counts.get({e})) << e;
    for (int64_t b = 0; b < B; ++b) ASSERT_EQ(got_seq.get({b, e}), seq_counts.get({b, e})) << b;
  }

  // Loss values: the batch form (with a larger T_total), the sequence form, the z-loss.
  DeviceTensor loss_dev(3 * sizeof(float));
  float* losses = static_cast<float*>(loss_dev.ptr);
  LoadBalancingOptions lb;
  lb.k = 4, lb.coeff = 0.01f, lb.total_tokens = 2 * T;
  LoadBalancingOptions seq = lb;
  seq.total_tokens = 0;
  float want[3];
  ASSERT_TRUE(load_balancing_loss(scores.in(), counts.in(), lb, &want[0]).ok());
  ASSERT_TRUE(seq_load_balancing_loss(scores.in(), seq_counts.in(), seq, &want[1]).ok());
  ASSERT_TRUE(z_loss(logits.in(), 1e-3f, &want[2]).ok());
  DeviceTensor gcounts(counts), gseq(seq_counts);
  ASSERT_TRUE(load_balancing_loss(gs.in(scores), gcounts.in(counts), lb, &losses[0], exec).ok());
  ASSERT_TRUE(
      seq_load_balancing_loss(gs.in(scores), gseq.in(seq_counts), seq, &losses[1], exec).ok());
  ASSERT_TRUE(z_loss(gl.in(logits), 1e-3f, &losses[2], exec).ok());
  float got[3], again[3];
  CUDA_OK(cudaMemcpy(got, losses, sizeof got, cudaMemcpyDeviceToHost));
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(got[i], want[i], 1e-6 * (1 + std::fabs(want[i]))) << i;
  // The same call gives the same bits (the partial sums are added in one order).
  ASSERT_TRUE(z_loss(gl.in(logits), 1e-3f, &losses[2], exec).ok());
  CUDA_OK(cudaMemcpy(again, losses, sizeof again, cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(&got[2], &again[2], sizeof(float)), 0);
  // Too small a workspace is named.
  Exec small = exec;
  small.workspace_bytes = 8;
  const Status s = z_loss(gl.in(logits), 1e-3f, &losses[2], small);
  EXPECT_EQ(s.argument(), "exec.workspace_bytes") << s.message();

  // The gradients.
  auto expect_rows = [&](HostTensor& got_t, const HostTensor& want_t, const char* what) {
    for (int64_t i = 0; i < T * E; ++i) {
      ASSERT_NEAR(got_t.get_flat(i), want_t.get_flat(i), 1e-5 * (1 + std::fabs(want_t.get_flat(i))))
          << what << " element " << i;
    }
  };
  HostTensor want_d(DType::kF32, {T, E}), got_d(DType::kF32, {T, E});
  DeviceTensor gd(got_d);
  ASSERT_TRUE(load_balancing_loss_backward(counts.in(), lb, 0.5f, want_d.mut()).ok());
  ASSERT_TRUE(load_balancing_loss_backward(gcounts.in(counts), lb, 0.5f, gd.mut(got_d), exec).ok());
  CUDA_OK(cudaDeviceSynchronize());
  gd.download(got_d);
  expect_rows(got_d, want_d, "load_balancing_loss_backward");
  ASSERT_TRUE(seq_load_balancing_loss_backward(seq_counts.in(), seq, 0.5f, want_d.mut()).ok());
  ASSERT_TRUE(
      seq_load_balancing_loss_backward(gseq.in(seq_counts), seq, 0.5f, gd.mut(got_d), exec).ok());
  CUDA_OK(cudaDeviceSynchronize());
  gd.download(got_d);
  expect_rows(got_d, want_d, "seq_load_balancing_loss_backward");
  ASSERT_TRUE(z_loss_backward(logits.in(), 1e-3f, 2.0f, want_d.mut()).ok());
  ASSERT_TRUE(z_loss_backward(gl.in(logits), 1e-3f, 2.0f, gd.mut(got_d), exec).ok());
  CUDA_OK(cudaDeviceSynchronize());
  gd.download(got_d);
  expect_rows(got_d, want_d, "z_loss_backward");

  // The bias update: exact.
  HostTensor bias(DType::kF32, {E}), got_bias(DType::kF32, {E});
  bias.fill_random(rng);
  got_bias = bias;
  DeviceTensor gb(got_bias);
  ASSERT_TRUE(update_expert_bias(counts.in(), 1e-3f, bias.mut()).ok());
  ASSERT_TRUE(update_expert_bias(gcounts.in(counts), 1e-3f, gb.mut(got_bias), exec).ok());
  CUDA_OK(cudaDeviceSynchronize());
  gb.download(got_bias);
  EXPECT_EQ(got_bias.bytes, bias.bytes);

  // No tokens: the losses are 0.
  HostTensor none(DType::kF32, {0, E});
  ASSERT_TRUE(z_loss(gl.in(none), 1e-3f, &losses[2], exec).ok());
  CUDA_OK(cudaMemcpy(got, losses, sizeof got, cudaMemcpyDeviceToHost));
  EXPECT_EQ(got[2], 0.0f);
}

// The router's calls queue nothing that waits for the host: they are captured in a CUDA graph,
// and the graph's replay gives the bits of the direct calls.
TEST(RouterCudaGraph, CapturedCallsReplayTheSameBits) {
  MOEKIT_REQUIRE_GPU();
  const int64_t T = 77, E = 256;
  std::mt19937 rng(23);
  HostTensor logits(DType::kF32, {T, E}), idx(DType::kI32, {T, 8}), w(DType::kF32, {T, 8}),
      d_logits(DType::kF32, {T, E}), d_w(DType::kF32, {T, 8});
  logits.fill_random(rng);
  d_w.fill_random(rng);
  std::vector<float> bias(E, 0.01f);
  DeviceTensor gl(logits), gi(idx), gw(w), gd(d_logits), gdw(d_w), gb(E * sizeof(float)),
      ws(router_workspace_size(Device::kCuda, T, E)), loss(sizeof(float));
  gb.upload(bias.data(), E * sizeof(float));
  RouteOptions o;
  o.k = 8, o.score = RouterScore::kSigmoid, o.num_groups = 8, o.group_topk = 4;
  o.expert_bias = {static_cast<const float*>(gb.ptr), static_cast<size_t>(E)};
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  const Exec exec = cuda_exec(&ws, stream);
  auto calls = [&]() {
    EXPECT_TRUE(route(gl.in(logits), o, {{}, {}, gi.mut(idx), gw.mut(w)}, exec).ok());
    EXPECT_TRUE(
        route_backward(gl.in(logits), gi.in(idx), {}, gdw.in(d_w), o, gd.mut(d_logits), exec).ok());
    EXPECT_TRUE(z_loss(gl.in(logits), 0.1f, static_cast<float*>(loss.ptr), exec).ok());
  };
  calls();
  CUDA_OK(cudaStreamSynchronize(stream));
  HostTensor direct = d_logits, direct_w = w;
  gd.download(direct), gw.download(direct_w);
  float direct_loss;
  CUDA_OK(cudaMemcpy(&direct_loss, loss.ptr, sizeof(float), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemset(gd.ptr, 0, gd.bytes));
  cudaGraph_t graph;
  cudaGraphExec_t instance;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  calls();
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  CUDA_OK(cudaGraphInstantiate(&instance, graph, 0));
  for (int replay = 0; replay < 2; ++replay) CUDA_OK(cudaGraphLaunch(instance, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  HostTensor replayed = d_logits, replayed_w = w;
  gd.download(replayed), gw.download(replayed_w);
  float replayed_loss;
  CUDA_OK(cudaMemcpy(&replayed_loss, loss.ptr, sizeof(float), cudaMemcpyDeviceToHost));
  EXPECT_EQ(replayed.bytes, direct.bytes);
  EXPECT_EQ(replayed_w.bytes, direct_w.bytes);
  EXPECT_EQ(std::memcmp(&replayed_loss, &direct_loss, sizeof(float)), 0);
  cudaGraphExecDestroy(instance);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

#endif  // MOEKIT_HAS_CUDA

}  // namespace
}  // namespace moekit
