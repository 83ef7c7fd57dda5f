// The permutation on CUDA buffers (permute.h with Exec::device = kCuda) against the CPU's
// threaded implementation on the same inputs: permute's outputs byte for byte (rows are copies,
// the row map, counts and offsets integers), the sums of unpermute and the backward passes
// within f32 rounding, sort_chunks_by_index byte for byte.
//
// Without a GPU (or built without CUDA) the tests that need one skip with a message; the
// host-side argument checks run anyway.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "host_tensor.h"
#include "moekit/permute.h"
#include "routing_spread.h"

#if MOEKIT_HAS_CUDA
#include "device_tensor.h"
#endif

namespace moekit {
namespace {

// --- Host-side checks: made before anything touches the device --------------------------------

TEST(PermuteCudaHost, TheBufferMustHoldTheWorstCase) {
  const int64_t T = 10, E = 4, H = 8;
  HostTensor x(DType::kF32, {T, H}), idx(DType::kI32, {T, 2}), tpe(DType::kI32, {E}),
      row_map(DType::kI32, {2, T, 2});
  const Exec exec{Device::kCuda, nullptr, nullptr, 0};
  PermuteOptions o;
  o.align_size = 8;
  const int64_t need = permute_max_rows(T, E, 2, o);
  HostTensor small(DType::kF32, {need - 1, H});
  Status s =
      permute(x.in(), idx.in(), {}, o, {small.mut(), {}, tpe.mut(), row_map.mut(), {}}, exec);
  if (!cuda_built()) {
    EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s.message();
    return;
  }
  EXPECT_EQ(s.argument(), "out.x.shape") << s.message();
  EXPECT_NE(s.message().find(std::to_string(need)), std::string::npos) << s.message();
  // A routing map on CUDA needs k (it sizes the buffer).
  HostTensor map(DType::kBool, {T, E}), map_rows(DType::kI32, {2, T, E});
  s = permute(x.in(), map.in(), {}, {}, {small.mut(), {}, tpe.mut(), map_rows.mut(), {}}, exec);
  EXPECT_EQ(s.argument(), "k") << s.message();
  EXPECT_EQ(permute_workspace_size(Device::kCpu, T, 2, E, need), 0u);
  EXPECT_EQ(permute_workspace_size(Device::kCuda, -1, 2, E, need), SIZE_MAX);
}

#if MOEKIT_HAS_CUDA

// --- On the GPU ---------------------------------------------------------------------------------

struct PermuteCase {
  std::string name;
  int64_t T, E;
  int32_t k;
  int64_t H;
  bool map_form;
  DType dtype;
  Spread spread = Spread::kRandom;
  int64_t align = 1;
  double capacity_factor = 0.0;
  DropPolicy policy = DropPolicy::kProbs;
  bool pad_to_capacity = false;
};
void PrintTo(const PermuteCase& c, std::ostream* os) { *os << c.name; }

std::vector<PermuteCase> permute_cases() {
  using D = DropPolicy;
  const DType f = DType::kF32, b = DType::kBF16;
  return {
      {"T1_E1_k1_H1", 1, 1, 1, 1, false, f},
      {"T0_E4_k2_H8_align4", 0, 4, 2, 8, false, f, Spread::kRandom, 4},
      {"T7_E4_k2_H7_bf16", 7, 4, 2, 7, false, b},
      {"T111_E8_k2_H64_map_cap_probs", 111, 8, 2, 64, true, f, Spread::kRandom, 1, 1.0, D::kProbs},
      {"T500_E128_k8_H256_bf16", 500, 128, 8, 256, false, b},
      {"T111_E16_k4_H48_allone", 111, 16, 4, 48, false, f, Spread::kAllOne},
      {"T111_E16_k4_H40_halfempty_align16_bf16", 111, 16, 4, 40, false, b, Spread::kHalfEmpty, 16},
      {"T500_E64_k6_H32_cap50_probs", 500, 64, 6, 32, false, f, Spread::kRandom, 1, 0.5, D::kProbs},
      {"T500_E64_k6_H32_cap50_position_padded_bf16", 500, 64, 6, 32, false, b, Spread::kRandom, 1,
       0.5, D::kPosition, true},
      {"T111_E8_k3_H17_map_cap125_position_align4_bf16", 111, 8, 3, 17, true, b, Spread::kRandom, 4,
       1.25, D::kPosition},
      {"T111_E16_k4_H48_allone_cap_probs_align8", 111, 16, 4, 48, false, f, Spread::kAllOne, 8, 1.0,
       D::kProbs},
  };
}

// The routing: topk_indices [T, k] (distinct experts per token) or a routing map [T, E] with k
// ones per row; every token to the last expert (kAllOne), or only the odd experts (kHalfEmpty).
HostTensor make_routing(const PermuteCase& c, std::mt19937& rng) {
  HostTensor r(c.map_form ? DType::kBool : DType::kI32, {c.T, c.map_form ? c.E : c.k});
  const auto experts = spread_routing(c.spread, c.T, c.E, c.k, rng);
  for (int64_t t = 0; t < c.T; ++t) {
    for (int32_t j = 0; j < c.k; ++j) {
      if (c.map_form) {
        r.set({t, experts[t][j]}, 1);
      } else {
        r.set({t, j}, experts[t][j]);
      }
    }
  }
  return r;
}

// Probs with exact ties, -0.0 beside +0.0 and NaN, which the probs policy orders by rule.
HostTensor make_probs(const PermuteCase& c, int64_t S, std::mt19937& rng) {
  HostTensor p(c.dtype, {c.T, S});
  std::uniform_int_distribution<int> level(0, 8);
  for (int64_t i = 0; i < c.T * S; ++i) p.set_flat(i, level(rng) / 8.0);
  for (int64_t i = 0; i < c.T * S; i += 13) p.set_flat(i, -0.0);
  for (int64_t i = 5; i < c.T * S; i += 29) p.set_flat(i, std::numeric_limits<double>::quiet_NaN());
  return p;
}

void expect_same_bytes(const HostTensor& got, const HostTensor& want, const char* what) {
  ASSERT_EQ(got.span(), want.span()) << what;
  const size_t n = static_cast<size_t>(got.span()) * dtype_size(got.dtype);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(got.bytes[i], want.bytes[i]) << what << ": byte " << i << " of " << n;
  }
}

void expect_close(const HostTensor& got, const HostTensor& want, double tol, const char* what) {
  ASSERT_EQ(got.span(), want.span()) << what;
  for (int64_t i = 0; i < got.span(); ++i) {
    const double g = got.get_flat(i), w = want.get_flat(i);
    if (std::isnan(w) && std::isnan(g)) continue;
    ASSERT_NEAR(g, w, tol * (1 + std::fabs(w))) << what << ": element " << i;
  }
}

class PermuteCuda : public ::testing::TestWithParam<PermuteCase> {};

TEST_P(PermuteCuda, EveryCallMatchesTheCpu) {
  MOEKIT_REQUIRE_GPU();
  const PermuteCase c = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(c.T * 7 + c.E * 3 + c.H));
  const int64_t S = c.map_form ? c.E : c.k;
  PermuteOptions o;
  o.align_size = c.align;
  o.capacity_factor = c.capacity_factor;
  o.drop_policy = c.policy;
  o.pad_to_capacity = c.pad_to_capacity;
  o.k = c.k;
  const int64_t N = permute_max_rows(c.T, c.E, c.k, o);
  ASSERT_GE(N, 0);
  HostTensor routing = make_routing(c, rng), x(c.dtype, {c.T, c.H}), probs = make_probs(c, S, rng);
  x.fill_random(rng);
  const bool with_probs = c.capacity_factor > 0 || c.T % 2 == 1;  // probs moved along, or not
  DeviceTensor ws(permute_workspace_size(Device::kCuda, c.T, S, c.E, N));
  const Exec exec = cuda_exec(&ws);

  // permute.
  HostTensor x_perm(c.dtype, {N, c.H}), probs_perm(c.dtype, {N}), tpe(DType::kI32, {c.E}),
      row_map(DType::kI32, {2, c.T, S}), pad(DType::kI32, {c.E});
  o.impl = PermuteImpl::kThreaded;
  ASSERT_TRUE(permute(x.in(), routing.in(), with_probs ? probs.in() : ConstTensorView{}, o,
                      {x_perm.mut(), with_probs ? probs_perm.mut() : TensorView{}, tpe.mut(),
                       row_map.mut(), pad.mut()})
                  .ok());
  HostTensor g_perm = x_perm, g_probs = probs_perm, g_tpe = tpe, g_map = row_map, g_pad = pad;
  for (HostTensor* t : {&g_perm, &g_probs}) t->fill(NAN);  // every row must be written
  for (HostTensor* t : {&g_tpe, &g_map, &g_pad}) t->fill(-7);
  DeviceTensor dx(x), dr(routing), dp(probs), dxp(g_perm), dpp(g_probs), dt(g_tpe), dm(g_map),
      dpad(g_pad);
  o.impl = PermuteImpl::kAuto;
  const Status s =
      permute(dx.in(x), dr.in(routing), with_probs ? dp.in(probs) : ConstTensorView{}, o,
              {dxp.mut(g_perm), with_probs ? dpp.mut(g_probs) : TensorView{}, dt.mut(g_tpe),
               dm.mut(g_map), dpad.mut(g_pad)},
              exec);
  ASSERT_TRUE(s.ok()) << s.message();
  CUDA_OK(cudaDeviceSynchronize());
  dxp.download(g_perm), dpp.download(g_probs), dt.download(g_tpe), dm.download(g_map);
  dpad.download(g_pad);
  expect_same_bytes(g_tpe, tpe, "tokens_per_expert");
  expect_same_bytes(g_pad, pad, "pad_offsets");
  expect_same_bytes(g_map, row_map, "row_map");
  expect_same_bytes(g_perm, x_perm, "x_perm");
  if (with_probs) expect_same_bytes(g_probs, probs_perm, "probs_perm");

  // unpermute, both output dtypes, with and without merging probs.
  HostTensor y(c.dtype, {N, c.H});
  y.fill_random(rng);
  DeviceTensor dy(y);
  const double tol = c.dtype == DType::kF32 ? 1e-6 : 8e-3;
  for (DType out_t : {DType::kF32, c.dtype}) {
    for (bool weighted : {false, true}) {
      HostTensor want(out_t, {c.T, c.H}), got(out_t, {c.T, c.H});
      const ConstTensorView w = weighted ? probs.in() : ConstTensorView{};
      ASSERT_TRUE(unpermute(y.in(), row_map.in(), w, want.mut()).ok());
      got.fill(NAN);
      DeviceTensor dg(got);
      ASSERT_TRUE(unpermute(dy.in(y), dm.in(row_map), weighted ? dp.in(probs) : ConstTensorView{},
                            dg.mut(got), PermuteImpl::kAuto, exec)
                      .ok());
      CUDA_OK(cudaDeviceSynchronize());
      dg.download(got);
      expect_close(got, want, tol, weighted ? "unpermute, weighted" : "unpermute");
    }
  }

  // permute_backward: d_x sums the copies, d_probs gathers.
  {
    HostTensor d_probs_perm(DType::kF32, {N}), want_x(DType::kF32, {c.T, c.H}),
        want_p(DType::kF32, {c.T, S});
    d_probs_perm.fill_random(rng);
    ASSERT_TRUE(
        permute_backward(y.in(), d_probs_perm.in(), row_map.in(), want_x.mut(), want_p.mut()).ok());
    HostTensor got_x = want_x, got_p = want_p;
    got_x.fill(NAN), got_p.fill(NAN);
    DeviceTensor dd(d_probs_perm), gx(got_x), gp(got_p);
    ASSERT_TRUE(permute_backward(dy.in(y), dd.in(d_probs_perm), dm.in(row_map), gx.mut(got_x),
                                 gp.mut(got_p), PermuteImpl::kAuto, exec)
                    .ok());
    CUDA_OK(cudaDeviceSynchronize());
    gx.download(got_x), gp.download(got_p);
    expect_close(got_x, want_x, tol, "permute_backward d_x");
    expect_same_bytes(got_p, want_p, "permute_backward d_probs");
  }

  // unpermute_backward: d_y_perm (padding rows zero) and the merging probs' gradient.
  {
    HostTensor d_out(c.dtype, {c.T, c.H}), want_y(c.dtype, {N, c.H}), want_w(DType::kF32, {c.T, S});
    d_out.fill_random(rng);
    HostTensor clean_probs = probs;  // NaN weights would make the comparison meaningless
    for (int64_t i = 0; i < c.T * S; ++i) {
      if (std::isnan(clean_probs.get_flat(i))) clean_probs.set_flat(i, 0.25);
    }
    ASSERT_TRUE(unpermute_backward(d_out.in(), y.in(), row_map.in(), clean_probs.in(), want_y.mut(),
                                   want_w.mut())
                    .ok());
    HostTensor got_y = want_y, got_w = want_w;
    got_y.fill(NAN), got_w.fill(NAN);
    DeviceTensor dd(d_out), dc(clean_probs), gy(got_y), gw(got_w);
    ASSERT_TRUE(unpermute_backward(dd.in(d_out), dy.in(y), dm.in(row_map), dc.in(clean_probs),
                                   gy.mut(got_y), gw.mut(got_w), PermuteImpl::kAuto, exec)
                    .ok());
    CUDA_OK(cudaDeviceSynchronize());
    gy.download(got_y), gw.download(got_w);
    expect_same_bytes(got_y, want_y, "unpermute_backward d_y_perm");
    expect_close(got_w, want_w, 1e-5, "unpermute_backward d_merging_probs");
  }
}

INSTANTIATE_TEST_SUITE_P(Gpu, PermuteCuda, ::testing::ValuesIn(permute_cases()),
                         [](const auto& info) { return info.param.name; });

// Values the host cannot check are clamped on the device: a topk index outside [0, E) is a slot
// not routed, a row map's row outside [0, N) counts as -1. The calls run (memcheck: in bounds),
// and equal the CPU's on the inputs with those entries made explicit.
TEST(PermuteCudaClamp, OutOfRangeIndicesAndRows) {
  MOEKIT_REQUIRE_GPU();
  const int64_t T = 9, E = 4, H = 16, k = 2;
  std::mt19937 rng(3);
  HostTensor x(DType::kF32, {T, H}), idx(DType::kI32, {T, k});
  x.fill_random(rng);
  for (int64_t t = 0; t < T; ++t) idx.set({t, 0}, t % E), idx.set({t, 1}, (t + 1) % E);
  idx.set({2, 1}, -5);
  idx.set({7, 0}, E + 3);
  const int64_t N = permute_max_rows(T, E, k, {});
  DeviceTensor ws(permute_workspace_size(Device::kCuda, T, k, E, N));
  HostTensor x_perm(DType::kF32, {N, H}), tpe(DType::kI32, {E}), row_map(DType::kI32, {2, T, k});
  DeviceTensor dx(x), di(idx), dxp(x_perm), dt(tpe), dm(row_map);
  ASSERT_TRUE(permute(dx.in(x), di.in(idx), {}, {},
                      {dxp.mut(x_perm), {}, dt.mut(tpe), dm.mut(row_map), {}}, cuda_exec(&ws))
                  .ok());
  CUDA_OK(cudaDeviceSynchronize());
  dm.download(row_map), dt.download(tpe);
  EXPECT_EQ(row_map.get({0, 2, 1}), -1);
  EXPECT_EQ(row_map.get({1, 2, 1}), -1);
  EXPECT_EQ(row_map.get({0, 7, 0}), -1);
  int64_t routed = 0;
  for (int64_t e = 0; e < E; ++e) routed += static_cast<int64_t>(tpe.get({e}));
  EXPECT_EQ(routed, T * k - 2);
  // unpermute with rows past N and below -1.
  row_map.set({0, 3, 0}, static_cast<double>(N + 10));
  row_map.set({0, 4, 1}, -9);
  HostTensor y(DType::kF32, {N, H}), out(DType::kF32, {T, H}), want(DType::kF32, {T, H});
  y.fill_random(rng);
  HostTensor clean = row_map;
  clean.set({0, 3, 0}, -1), clean.set({0, 4, 1}, -1);
  ASSERT_TRUE(unpermute(y.in(), clean.in(), {}, want.mut()).ok());
  DeviceTensor dy(y), dm2(row_map), dout(out);
  ASSERT_TRUE(
      unpermute(dy.in(y), dm2.in(row_map), {}, dout.mut(out), PermuteImpl::kAuto, cuda_exec())
          .ok());
  CUDA_OK(cudaDeviceSynchronize());
  dout.download(out);
  expect_close(out, want, 1e-6, "unpermute with clamped rows");
}

// sort_chunks_by_index, forward and inverse, with probs, on uneven chunks (empty ones
// included) and rows past the chunks, against the CPU.
TEST(SortChunksCuda, MatchesTheCpu) {
  MOEKIT_REQUIRE_GPU();
  std::mt19937 rng(9);
  for (DType t : {DType::kF32, DType::kBF16}) {
    for (int64_t H : {1, 7, 64}) {
      const std::vector<int32_t> sizes = {3, 0, 5, 1, 0, 7, 2, 4};
      const int64_t C = static_cast<int64_t>(sizes.size()), N = 25;  // 22 rows in chunks
      std::vector<int32_t> index(C);
      std::iota(index.begin(), index.end(), 0);
      std::shuffle(index.begin(), index.end(), rng);
      HostTensor x(t, {N, H}), probs(t, {N}), split(DType::kI32, {C}), sorted(DType::kI32, {C});
      x.fill_random(rng), probs.fill_random(rng);
      for (int64_t c = 0; c < C; ++c) split.set({c}, sizes[c]), sorted.set({c}, index[c]);
      DeviceTensor ws(permute_workspace_size(Device::kCuda, 0, 0, C, N));
      DeviceTensor dx(x), dp(probs), ds(split), di(sorted);
      for (bool inverse : {false, true}) {
        HostTensor want(t, {N, H}), want_p(t, {N});
        ASSERT_TRUE(sort_chunks_by_index(x.in(), split.in(), sorted.in(), inverse, want.mut(),
                                         probs.in(), want_p.mut())
                        .ok());
        HostTensor got = want, got_p = want_p;
        got.fill(NAN), got_p.fill(NAN);
        DeviceTensor dg(got), dgp(got_p);
        ASSERT_TRUE(sort_chunks_by_index(dx.in(x), ds.in(split), di.in(sorted), inverse,
                                         dg.mut(got), dp.in(probs), dgp.mut(got_p),
                                         PermuteImpl::kAuto, cuda_exec(&ws))
                        .ok());
        CUDA_OK(cudaDeviceSynchronize());
        dg.download(got), dgp.download(got_p);
        expect_same_bytes(got, want, inverse ? "inverse rows" : "rows");
        expect_same_bytes(got_p, want_p, inverse ? "inverse probs" : "probs");
      }
    }
  }
}

// A permutation pass queues nothing that waits for the host: captured in a CUDA graph, its
// replay gives the bits of the direct calls.
TEST(PermuteCudaGraph, CapturedCallsReplayTheSameBits) {
  MOEKIT_REQUIRE_GPU();
  const int64_t T = 300, E = 32, k = 4, H = 128;
  std::mt19937 rng(4);
  PermuteCase c{"graph", T, E, k, H, false, DType::kBF16};
  HostTensor idx = make_routing(c, rng), x(DType::kBF16, {T, H}), w(DType::kF32, {T, k});
  x.fill_random(rng), w.fill_random(rng);
  PermuteOptions o;
  o.align_size = 16;
  o.capacity_factor = 0.8;
  const int64_t N = permute_max_rows(T, E, k, o);
  HostTensor x_perm(DType::kBF16, {N, H}), tpe(DType::kI32, {E}), row_map(DType::kI32, {2, T, k}),
      out(DType::kF32, {T, H});
  DeviceTensor ws(permute_workspace_size(Device::kCuda, T, k, E, N)), dx(x), di(idx), dw(w),
      dxp(x_perm), dt(tpe), dm(row_map), dout(out);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  const Exec exec = cuda_exec(&ws, stream);
  auto calls = [&]() {
    EXPECT_TRUE(permute(dx.in(x), di.in(idx), dw.in(w), o,
                        {dxp.mut(x_perm), {}, dt.mut(tpe), dm.mut(row_map), {}}, exec)
                    .ok());
    EXPECT_TRUE(
        unpermute(dxp.in(x_perm), dm.in(row_map), dw.in(w), dout.mut(out), PermuteImpl::kAuto, exec)
            .ok());
  };
  calls();
  CUDA_OK(cudaStreamSynchronize(stream));
  HostTensor direct = out, direct_map = row_map;
  dout.download(direct), dm.download(direct_map);
  CUDA_OK(cudaMemset(dout.ptr, 0, dout.bytes));
  CUDA_OK(cudaMemset(dm.ptr, 0, dm.bytes));
  cudaGraph_t graph;
  cudaGraphExec_t instance;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  calls();
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  CUDA_OK(cudaGraphInstantiate(&instance, graph, 0));
  CUDA_OK(cudaGraphLaunch(instance, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  HostTensor replayed = out, replayed_map = row_map;
  dout.download(replayed), dm.download(replayed_map);
  EXPECT_EQ(replayed.bytes, direct.bytes);
  EXPECT_EQ(replayed_map.bytes, direct_map.bytes);
  cudaGraphExecDestroy(instance);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

#endif  // MOEKIT_HAS_CUDA

}  // namespace
}  // namespace moekit
