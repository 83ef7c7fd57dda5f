// The activation and the whole MoE layer on CUDA buffers against the CPU's on the same inputs:
// activation and its backward within f32 rounding; the layer's output, losses, rows per expert,
// input gradient and every weight gradient within the rounding of sums taken in another order
// (cuBLAS and CUTLASS against oneDNN), the rows per expert exactly; and a forward + backward
// pass captured in a CUDA graph, whose replay gives the direct pass's bits.
//
// Without a GPU (or built without CUDA) the tests that need one skip with a message; the
// host-side argument checks run anyway.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "host_tensor.h"
#include "moekit/layer.h"

#if MOEKIT_HAS_CUDA
#include "device_tensor.h"
#endif

namespace moekit {
namespace {

using Bytes = std::vector<std::byte, Aligned64Allocator<std::byte>>;

MoeLayerConfig small_config() {
  MoeLayerConfig c;
  c.hidden = 64, c.ffn = 32, c.num_experts = 16;
  c.route.k = 4;
  return c;
}

// --- Host-side checks: made before anything touches the device --------------------------------

TEST(LayerCudaHost, WhatCudaDoesNotTakeIsNamed) {
  MoeLayerConfig c = small_config();
  const int64_t T = 5;
  HostTensor x(DType::kBF16, {T, c.hidden}), router(DType::kBF16, {c.hidden, c.num_experts}),
      w_in(DType::kBF16, {c.num_experts, c.hidden, 2 * c.ffn}),
      w_out(DType::kBF16, {c.num_experts, c.ffn, c.hidden}), out(DType::kBF16, {T, c.hidden});
  const MoeLayerWeights w{router.in(), w_in.in(), w_out.in(), {}, {}};
  const Exec exec{Device::kCuda, nullptr, nullptr, 0};
  const MoeLayerWorkspace cpu = moe_layer_workspace(c, T, DType::kBF16);
  const MoeLayerWorkspace gpu = moe_layer_workspace(c, T, DType::kBF16, Device::kCuda);
  Bytes saved(gpu.saved_bytes + 512), scratch(std::max(gpu.forward_bytes, cpu.forward_bytes) + 512);
  Status s = moe_layer_forward(x.in(), w, c, saved, scratch, {out.mut()}, nullptr, exec);
  if (!cuda_built()) {
    EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s.message();
    return;
  }
  // The ops' workspace is in the CUDA scratch.
  EXPECT_GT(gpu.forward_bytes, cpu.forward_bytes);
  EXPECT_GT(gpu.backward_bytes, cpu.backward_bytes);
  // The buffers on CUDA start at 256 bytes (the ops' workspace needs it).
  std::byte* base = saved.data();
  while (reinterpret_cast<uintptr_t>(base) % 256 != 64) ++base;
  s = moe_layer_forward(x.in(), w, c, std::span(base, gpu.saved_bytes),
                        std::span(scratch).first(gpu.forward_bytes), {out.mut()}, nullptr, exec);
  EXPECT_EQ(s.argument(), "saved.data()") << s.message();
  c.batch_invariant = true;
  s = moe_layer_forward(x.in(), w, c, saved, scratch, {out.mut()}, nullptr, exec);
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s.message();
  c.batch_invariant = false;
  c.num_experts = 1025;
  s = moe_layer_forward(x.in(), w, c, saved, scratch, {out.mut()}, nullptr, exec);
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s.message();
}

#if MOEKIT_HAS_CUDA

// --- On the GPU ---------------------------------------------------------------------------------

// The activation and its backward against the CPU's, on aligned and unaligned rows.
TEST(ActivationCuda, MatchesTheCpu) {
  MOEKIT_REQUIRE_GPU();
  std::mt19937 rng(21);
  for (Activation act :
       {Activation::kSwiGLU, Activation::kGeGLU, Activation::kGelu, Activation::kRelu}) {
    for (DType t : {DType::kF32, DType::kBF16}) {
      for (auto [N, F, pad] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 0},
                               {7, 13, 3},
                               {111, 64, 0},
                               {500, 768, 8},
                               {0, 8, 0}}) {
        SCOPED_TRACE(testing::Message() << "act " << static_cast<int>(act) << " dtype "
                                        << dtype_name(t) << " N " << N << " F " << F);
        const int64_t W = is_gated(act) ? 2 * F : F;
        HostTensor h(t, {N, W}, pad), d_a(t, {N, F}), a(t, {N, F}), d_h(t, {N, W}, pad);
        h.fill_random(rng), d_a.fill_random(rng);
        ASSERT_TRUE(activation(h.in(), act, a.mut()).ok());
        ASSERT_TRUE(activation_backward(h.in(), d_a.in(), act, d_h.mut()).ok());
        HostTensor ga = a, gdh = d_h;
        ga.fill(NAN), gdh.fill(NAN);
        DeviceTensor dh(h), dda(d_a), dga(ga), dgdh(gdh);
        ASSERT_TRUE(
            activation(dh.in(h), act, dga.mut(ga), ActivationImpl::kAuto, cuda_exec()).ok());
        ASSERT_TRUE(activation_backward(dh.in(h), dda.in(d_a), act, dgdh.mut(gdh),
                                        ActivationImpl::kAuto, cuda_exec())
                        .ok());
        CUDA_OK(cudaDeviceSynchronize());
        dga.download(ga), dgdh.download(gdh);
        const double tol = t == DType::kF32 ? 2e-6 : 1.0 / 128;
        for (int64_t r = 0; r < N; ++r) {
          for (int64_t j = 0; j < F; ++j) {
            ASSERT_NEAR(ga.get({r, j}), a.get({r, j}), tol * (1 + std::fabs(a.get({r, j}))))
                << r << ", " << j;
          }
          for (int64_t j = 0; j < W; ++j) {
            ASSERT_NEAR(gdh.get({r, j}), d_h.get({r, j}), tol * (1 + std::fabs(d_h.get({r, j}))))
                << r << ", " << j;
          }
        }
      }
    }
  }
}

struct LayerCudaCase {
  std::string name;
  MoeLayerConfig cfg;
  int64_t T;
  DType dt;
  bool bias = false;
  bool ffn_biases = false;  // the expert FFNs' b_in and b_out
};
void PrintTo(const LayerCudaCase& c, std::ostream* os) { *os << c.name; }

std::vector<LayerCudaCase> layer_cases() {
  std::vector<LayerCudaCase> v;
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const std::string d = dtype_name(dt).data();
    for (int64_t T : {1, 7, 111}) {
      MoeLayerConfig c = small_config();
      c.aux_loss_coeff = 0.01f, c.z_loss_coeff = 1e-3f;
      v.push_back({"qwen_like_T" + std::to_string(T) + "_" + d, c, T, dt});
    }
    MoeLayerConfig ds;  // DeepSeek-V3's routing and a shared expert
    ds.hidden = 128, ds.ffn = 64, ds.num_experts = 32, ds.shared_ffn = 64;
    ds.route.k = 4, ds.route.score = RouterScore::kSigmoid, ds.route.num_groups = 4;
    ds.route.group_topk = 2, ds.route.scaling_factor = 2.5f;
    ds.activation = Activation::kGeGLU;
    ds.aux_loss_coeff = 0.01f;
    v.push_back({"deepseek_like_T111_" + d, ds, 111, dt, true});
    MoeLayerConfig cap = small_config();  // drops, alignment, the per-sequence loss
    cap.capacity_factor = 0.75, cap.align_size = 8, cap.activation = Activation::kRelu;
    cap.aux_loss_coeff = 0.02f, cap.aux_loss_sequences = 3;
    v.push_back({"capacity_align_seqloss_T111_" + d, cap, 111, dt});
    MoeLayerConfig pre = small_config();  // pre-softmax, non-gated, padded to the capacity
    pre.route.pre_softmax = true, pre.activation = Activation::kGelu;
    pre.capacity_factor = 1.0, pre.drop_policy = DropPolicy::kPosition, pre.pad_to_capacity = true;
    v.push_back({"presoftmax_gelu_padded_T37_" + d, pre, 37, dt});
    MoeLayerConfig oss = small_config();  // gpt-oss: the expert FFNs' biases, padding rows too
    oss.align_size = 8, oss.z_loss_coeff = 1e-3f;
    v.push_back({"ffn_biases_aligned_T111_" + d, oss, 111, dt, false, true});
    MoeLayerConfig oss_cap = small_config();
    oss_cap.capacity_factor = 1.0, oss_cap.pad_to_capacity = true;
    v.push_back({"ffn_biases_padded_T37_" + d, oss_cap, 37, dt, false, true});
    MoeLayerConfig t = small_config();  // the experts' weights [E, out, in], read as they lie
    t.expert_weights_transposed = true, t.aux_loss_coeff = 0.01f;
    v.push_back({"expert_weights_transposed_T111_" + d, t, 111, dt, false, true});
  }
  return v;
}

// An expert's weight [E, in, out], or [E, out, in] where the config says so.
std::vector<int64_t> expert_dims(const MoeLayerConfig& c, int64_t in, int64_t out) {
  if (c.expert_weights_transposed) return {c.num_experts, out, in};
  return {c.num_experts, in, out};
}

// The host tensors of one layer call and their device copies.
struct LayerData {
  MoeLayerConfig cfg;
  int64_t T;
  DType dt;
  HostTensor x, router, w_in, w_out, shared_in, shared_out, b_in, b_out, d_out;
  std::vector<float> bias;
  bool ffn_biases;

  LayerData(const LayerCudaCase& c, uint32_t seed)
      : cfg(c.cfg),
        T(c.T),
        dt(c.dt),
        x(c.dt, {c.T, c.cfg.hidden}),
        router(c.dt, {c.cfg.hidden, c.cfg.num_experts}),
        w_in(c.dt, expert_dims(c.cfg, c.cfg.hidden, width(c.cfg.ffn))),
        w_out(c.dt, expert_dims(c.cfg, c.cfg.ffn, c.cfg.hidden)),
        shared_in(c.dt, {c.cfg.hidden, width(c.cfg.shared_ffn)}),
        shared_out(c.dt, {c.cfg.shared_ffn, c.cfg.hidden}),
        b_in(c.dt, {c.cfg.num_experts, width(c.cfg.ffn)}),
        b_out(c.dt, {c.cfg.num_experts, c.cfg.hidden}),
        d_out(c.dt, {c.T, c.cfg.hidden}),
        ffn_biases(c.ffn_biases) {
    std::mt19937 rng(seed);
    for (HostTensor* h :
         {&x, &router, &w_in, &w_out, &shared_in, &shared_out, &b_in, &b_out, &d_out}) {
      h->fill_random(rng);
    }
    if (c.bias) {
      std::uniform_real_distribution<float> u(-0.1f, 0.1f);
      for (int64_t e = 0; e < c.cfg.num_experts; ++e) bias.push_back(u(rng));
    }
  }
  int64_t width(int64_t f) const { return is_gated(cfg.activation) ? 2 * f : f; }
};

// What a pass returns, on the host.
struct LayerResult {
  HostTensor out, tpe, d_x, g_router, g_in, g_out, g_sin, g_sout, g_b_in, g_b_out;
  float aux = 0, z = 0;
  explicit LayerResult(const LayerData& d)
      : out(d.dt, d.x.shape),
        tpe(DType::kI32, {d.cfg.num_experts}),
        d_x(d.dt, d.x.shape),
        g_router(DType::kF32, d.router.shape),
        g_in(DType::kF32, d.w_in.shape),
        g_out(DType::kF32, d.w_out.shape),
        g_sin(DType::kF32, d.shared_in.shape),
        g_sout(DType::kF32, d.shared_out.shape),
        g_b_in(DType::kF32, d.b_in.shape),
        g_b_out(DType::kF32, d.b_out.shape) {}
  MoeLayerWeightGrads grads_of(const LayerData& d, const TensorView& router, const TensorView& in,
                               const TensorView& out, const TensorView& s_in,
                               const TensorView& s_out, const TensorView& b_in,
                               const TensorView& b_out) const {
    MoeLayerWeightGrads g;
    g.router = router, g.w_in = in, g.w_out = out;
    if (d.cfg.shared_ffn > 0) g.shared_in = s_in, g.shared_out = s_out;
    if (d.ffn_biases) g.b_in = b_in, g.b_out = b_out;
    return g;
  }
};

MoeLayerWeights weights_of(const LayerData& d, const ConstTensorView& router,
                           const ConstTensorView& w_in, const ConstTensorView& w_out,
                           const ConstTensorView& s_in, const ConstTensorView& s_out,
                           const ConstTensorView& b_in, const ConstTensorView& b_out) {
  MoeLayerWeights w;
  w.router = router, w.w_in = w_in, w.w_out = w_out;
  if (d.cfg.shared_ffn > 0) w.shared_in = s_in, w.shared_out = s_out;
  if (d.ffn_biases) w.b_in = b_in, w.b_out = b_out;
  return w;
}

LayerResult cpu_layer(LayerData& d) {
  LayerResult r(d);
  MoeLayerConfig cfg = d.cfg;
  cfg.route.expert_bias = d.bias;
  const MoeLayerWorkspace ws = moe_layer_workspace(cfg, d.T, d.dt);
  Bytes saved(ws.saved_bytes), fwd(ws.forward_bytes), bwd(ws.backward_bytes);
  const MoeLayerWeights w =
      weights_of(d, d.router.in(), d.w_in.in(), d.w_out.in(), d.shared_in.in(), d.shared_out.in(),
                 d.b_in.in(), d.b_out.in());
  Status s =
      moe_layer_forward(d.x.in(), w, cfg, saved, fwd, {r.out.mut(), &r.aux, &r.z, r.tpe.mut()});
  EXPECT_TRUE(s.ok()) << s.message();
  const MoeLayerWeightGrads g =
      r.grads_of(d, r.g_router.mut(), r.g_in.mut(), r.g_out.mut(), r.g_sin.mut(), r.g_sout.mut(),
                 r.g_b_in.mut(), r.g_b_out.mut());
  s = moe_layer_backward(d.x.in(), w, cfg, saved, d.d_out.in(), 0.7f, 1.3f, bwd, r.d_x.mut(), g);
  EXPECT_TRUE(s.ok()) << s.message();
  return r;
}

// The layer on the device: every input, output, buffer and loss in device memory.
struct GpuLayer {
  LayerData& d;
  LayerResult r;
  DeviceTensor x, router, w_in, w_out, s_in, s_out, b_in, b_out, d_out, out, tpe, d_x, g_router,
      g_in, g_out, g_sin, g_sout, g_b_in, g_b_out, bias, losses, saved, fwd, bwd;
  MoeLayerConfig cfg;

  static size_t bytes_of(const LayerData& d, size_t MoeLayerWorkspace::*which) {
    return moe_layer_workspace(d.cfg, d.T, d.dt, Device::kCuda).*which;
  }
  explicit GpuLayer(LayerData& data)
      : d(data),
        r(data),
        x(data.x),
        router(data.router),
        w_in(data.w_in),
        w_out(data.w_out),
        s_in(data.shared_in),
        s_out(data.shared_out),
        b_in(data.b_in),
        b_out(data.b_out),
        d_out(data.d_out),
        out(r.out),
        tpe(r.tpe),
        d_x(r.d_x),
        g_router(r.g_router),
        g_in(r.g_in),
        g_out(r.g_out),
        g_sin(r.g_sin),
        g_sout(r.g_sout),
        g_b_in(r.g_b_in),
        g_b_out(r.g_b_out),
        bias(data.bias.size() * sizeof(float)),
        losses(2 * sizeof(float)),
        saved(bytes_of(data, &MoeLayerWorkspace::saved_bytes)),
        fwd(bytes_of(data, &MoeLayerWorkspace::forward_bytes)),
        bwd(bytes_of(data, &MoeLayerWorkspace::backward_bytes)),
        cfg(data.cfg) {
    if (!d.bias.empty()) {
      bias.upload(d.bias.data(), d.bias.size() * sizeof(float));
      cfg.route.expert_bias = {static_cast<const float*>(bias.ptr), d.bias.size()};
    }
  }
  MoeLayerWeights weights() {
    return weights_of(d, router.in(d.router), w_in.in(d.w_in), w_out.in(d.w_out),
                      s_in.in(d.shared_in), s_out.in(d.shared_out), b_in.in(d.b_in),
                      b_out.in(d.b_out));
  }
  std::span<std::byte> span(DeviceTensor& t, size_t MoeLayerWorkspace::*which) {
    return {static_cast<std::byte*>(t.ptr), bytes_of(d, which)};
  }
  // Forward and backward queued on `stream`; nothing waits.
  Status pass(const Exec& exec) {
    float* l = static_cast<float*>(losses.ptr);
    MOEKIT_RETURN_IF_ERROR(
        moe_layer_forward(x.in(d.x), weights(), cfg, span(saved, &MoeLayerWorkspace::saved_bytes),
                          span(fwd, &MoeLayerWorkspace::forward_bytes),
                          {out.mut(r.out), &l[0], &l[1], tpe.mut(r.tpe)}, nullptr, exec));
    const MoeLayerWeightGrads g = r.grads_of(
        d, g_router.mut(r.g_router), g_in.mut(r.g_in), g_out.mut(r.g_out), g_sin.mut(r.g_sin),
        g_sout.mut(r.g_sout), g_b_in.mut(r.g_b_in), g_b_out.mut(r.g_b_out));
    return moe_layer_backward(x.in(d.x), weights(), cfg,
                              span(saved, &MoeLayerWorkspace::saved_bytes), d_out.in(d.d_out), 0.7f,
                              1.3f, span(bwd, &MoeLayerWorkspace::backward_bytes), d_x.mut(r.d_x),
                              g, nullptr, exec);
  }
  LayerResult& download() {
    for (auto [dev, host] : {std::pair{&out, &r.out},
                             {&tpe, &r.tpe},
                             {&d_x, &r.d_x},
                             {&g_router, &r.g_router},
                             {&g_in, &r.g_in},
                             {&g_out, &r.g_out},
                             {&g_sin, &r.g_sin},
                             {&g_sout, &r.g_sout},
                             {&g_b_in, &r.g_b_in},
                             {&g_b_out, &r.g_b_out}}) {
      dev->download(*host);
    }
    float l[2];
    expect_cuda(cudaMemcpy(l, losses.ptr, sizeof l, cudaMemcpyDeviceToHost), "losses");
    r.aux = l[0], r.z = l[1];
    return r;
  }
};

// max |got - want| <= tol * max |want| (sums in another order, rounded to the tensors' dtype).
void expect_close(const HostTensor& got, const HostTensor& want, double tol, const char* what) {
  double scale = 0, worst = 0;
  int64_t at = -1;
  const int64_t n = static_cast<int64_t>(want.bytes.size() / dtype_size(want.dtype));
  for (int64_t i = 0; i < n; ++i) scale = std::max(scale, std::fabs(want.get_flat(i)));
  for (int64_t i = 0; i < n; ++i) {
    const double e = std::fabs(got.get_flat(i) - want.get_flat(i));
    if (!(e <= worst)) worst = e, at = i;  // NaN counts as the worst
  }
  EXPECT_LE(worst, tol * std::max(scale, 1e-30))
      << what << ": element " << at << " is " << got.get_flat(at) << ", the CPU's "
      << want.get_flat(at);
}

class LayerCuda : public ::testing::TestWithParam<LayerCudaCase> {};

TEST_P(LayerCuda, ForwardAndBackwardMatchTheCpuLayer) {
  MOEKIT_REQUIRE_GPU();
  const LayerCudaCase c = GetParam();
  LayerData data(c, 31);
  const LayerResult want = cpu_layer(data);
  if (HasFailure()) return;
  GpuLayer gpu(data);
  const Status s = gpu.pass(cuda_exec());
  ASSERT_TRUE(s.ok()) << s.message();
  CUDA_OK(cudaDeviceSynchronize());
  const LayerResult& got = gpu.download();
  EXPECT_EQ(got.tpe.bytes, want.tpe.bytes) << "tokens_per_expert";
  const double tol = c.dt == DType::kF32 ? 1e-4 : 2e-2;
  expect_close(got.out, want.out, tol, "out");
  expect_close(got.d_x, want.d_x, tol, "d_x");
  expect_close(got.g_router, want.g_router, tol, "grads.router");
  expect_close(got.g_in, want.g_in, tol, "grads.w_in");
  expect_close(got.g_out, want.g_out, tol, "grads.w_out");
  if (c.cfg.shared_ffn > 0) {
    expect_close(got.g_sin, want.g_sin, tol, "grads.shared_in");
    expect_close(got.g_sout, want.g_sout, tol, "grads.shared_out");
  }
  if (c.ffn_biases) {
    expect_close(got.g_b_in, want.g_b_in, tol, "grads.b_in");
    expect_close(got.g_b_out, want.g_b_out, tol, "grads.b_out");
  }
  EXPECT_NEAR(got.aux, want.aux, 1e-4 * (1 + std::fabs(want.aux)));
  EXPECT_NEAR(got.z, want.z, 1e-4 * (1 + std::fabs(want.z)));
}

INSTANTIATE_TEST_SUITE_P(Gpu, LayerCuda, ::testing::ValuesIn(layer_cases()),
                         [](const auto& info) { return info.param.name; });

// A whole forward + backward pass queues nothing that waits for the host: it is captured in a
// CUDA graph, and the replay gives the direct pass's bits (the per-step profile, which waits on
// purpose, is not asked for).
TEST(LayerCudaGraph, APassIsCapturedAndReplaysTheSameBits) {
  MOEKIT_REQUIRE_GPU();
  const std::vector<LayerCudaCase> cases = layer_cases();
  const auto it = std::find_if(cases.begin(), cases.end(), [](const LayerCudaCase& c) {
    return c.name == "deepseek_like_T111_bf16";
  });
  ASSERT_NE(it, cases.end());
  LayerData data(*it, 5);
  GpuLayer gpu(data);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  const Exec exec = cuda_exec(nullptr, stream);
  ASSERT_TRUE(gpu.pass(exec).ok());
  CUDA_OK(cudaStreamSynchronize(stream));
  const LayerResult direct = gpu.download();
  CUDA_OK(cudaMemset(gpu.out.ptr, 0, gpu.out.bytes));
  CUDA_OK(cudaMemset(gpu.g_in.ptr, 0, gpu.g_in.bytes));
  cudaGraph_t graph;
  cudaGraphExec_t instance;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const Status s = gpu.pass(exec);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(s.ok()) << s.message();
  CUDA_OK(cudaGraphInstantiate(&instance, graph, 0));
  CUDA_OK(cudaGraphLaunch(instance, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  const LayerResult& replayed = gpu.download();
  EXPECT_EQ(replayed.out.bytes, direct.out.bytes);
  EXPECT_EQ(replayed.d_x.bytes, direct.d_x.bytes);
  EXPECT_EQ(replayed.g_in.bytes, direct.g_in.bytes);
  EXPECT_EQ(replayed.g_router.bytes, direct.g_router.bytes);
  cudaGraphExecDestroy(instance);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// A profiled pass on CUDA times every step it takes (it waits for the stream around each).
TEST(LayerCudaProfile, EveryStepHasATime) {
  MOEKIT_REQUIRE_GPU();
  LayerCudaCase c{"profile", small_config(), 64, DType::kBF16};
  LayerData data(c, 8);
  GpuLayer gpu(data);
  MoeLayerProfile prof;
  float* l = static_cast<float*>(gpu.losses.ptr);
  const Status s =
      moe_layer_forward(gpu.x.in(data.x), gpu.weights(), gpu.cfg,
                        gpu.span(gpu.saved, &MoeLayerWorkspace::saved_bytes),
                        gpu.span(gpu.fwd, &MoeLayerWorkspace::forward_bytes),
                        {gpu.out.mut(gpu.r.out), &l[0], &l[1], {}}, &prof, cuda_exec());
  ASSERT_TRUE(s.ok()) << s.message();
  for (MoeStep step : {MoeStep::kRouterGemm, MoeStep::kRoute, MoeStep::kPermute, MoeStep::kGmmUp,
                       MoeStep::kActivation, MoeStep::kGmmDown, MoeStep::kUnpermute}) {
    EXPECT_GT(prof.ms[static_cast<int>(step)], 0.0) << moe_step_name(step);
  }
}

#endif  // MOEKIT_HAS_CUDA

}  // namespace
}  // namespace moekit
