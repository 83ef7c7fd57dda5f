// Outputs that share memory with an input or another output (issue 22, item 2): every op refuses
// them with a named error before it writes anything (ragged_dot once accepted out == lhs and
// returned errors up to 1e17). Views of one buffer that do not share an element, such as column
// blocks of one matrix, are not aliases and still run.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "moekit/layer.h"
#include "moekit/permute.h"
#include "moekit/ragged_dot.h"
#include "moekit/router.h"

namespace moekit {
namespace {

std::string message(const Status& s) { return s.ok() ? "ok" : s.message(); }

// A [rows, cols] f32 view of `buf` from column `col`, rows `stride` floats apart.
TensorView block(std::vector<float>& buf, int64_t rows, int64_t cols, int64_t col, int64_t stride) {
  return TensorView(buf.data() + col, DType::kF32, {rows, cols}).with_stride(0, stride);
}

std::vector<float> ramp(size_t n, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = scale * static_cast<float>(i % 7) - 1.0f;
  return v;
}

TEST(Aliasing, RaggedDotOutputOnItsInputIsRefusedAndNothingIsWritten) {
  constexpr int64_t m = 6, K = 4, n = 4;
  std::vector<float> lhs = ramp(m * K, 0.5f), rhs = ramp(2 * K * n, 0.25f);
  const std::vector<float> before = lhs;
  const int32_t sizes[] = {2, 4}, fewer[] = {1, 4};
  const ConstTensorView r(rhs.data(), DType::kF32, {2, K, n});
  // out == lhs (K == n), and out one row into lhs.
  struct Case {
    const char* what;
    TensorView out;
    std::span<const int32_t> sizes;
  };
  const Case cases[] = {
      {"out is lhs", TensorView(lhs.data(), DType::kF32, {m, n}), sizes},
      {"out one row into lhs", TensorView(lhs.data() + K, DType::kF32, {m - 1, n}), fewer},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const ConstTensorView l(lhs.data(), DType::kF32, {c.out.shape[0], K});
    const Status s = ragged_dot(l, r, c.sizes, c.out);
    EXPECT_NE(message(s).find("overlaps lhs (an input)"), std::string::npos) << message(s);
    EXPECT_EQ(lhs, before);
  }
  const Status s = ragged_dot_drhs(ConstTensorView(lhs.data(), DType::kF32, {m, K}),
                                   ConstTensorView(lhs.data(), DType::kF32, {m, n}), sizes,
                                   TensorView(lhs.data(), DType::kF32, {1, K, n}));
  EXPECT_NE(message(s).find("ragged_dot_drhs: d_rhs"), std::string::npos) << message(s);
  EXPECT_EQ(lhs, before);
}

TEST(Aliasing, ColumnBlocksOfOneMatrixAreNotAliases) {
  // lhs = columns [0, K) and out = columns [K, K + n) of one [m, K + n] buffer: no shared element,
  // so the call runs, and gives what separate buffers give.
  constexpr int64_t m = 7, K = 5, n = 3, W = K + n;
  std::vector<float> buf = ramp(m * W, 0.5f), rhs = ramp(2 * K * n, 0.25f);
  std::vector<float> lhs_alone(m * K), out_alone(m * n, 0.0f);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < K; ++j) lhs_alone[i * K + j] = buf[i * W + j];
  }
  const int32_t sizes[] = {3, 4};
  const ConstTensorView r(rhs.data(), DType::kF32, {2, K, n});
  ASSERT_TRUE(ragged_dot(ConstTensorView(lhs_alone.data(), DType::kF32, {m, K}), r, sizes,
                         TensorView(out_alone.data(), DType::kF32, {m, n}))
                  .ok());
  const Status s = ragged_dot(block(buf, m, K, 0, W), r, sizes, block(buf, m, n, K, W));
  ASSERT_TRUE(s.ok()) << message(s);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) EXPECT_EQ(buf[i * W + K + j], out_alone[i * n + j]);
  }
  // The same buffer with out one column to the left shares column K - 1: refused.
  const Status bad = ragged_dot(block(buf, m, K, 0, W), r, sizes, block(buf, m, n, K - 1, W));
  EXPECT_NE(message(bad).find("overlaps lhs"), std::string::npos) << message(bad);
}

// Each op called with one output on an input or on another output; the error names both.
struct AliasCase {
  const char* what;
  std::function<Status()> call;
  const char* expect;  // a part of the message
};

TEST(Aliasing, EveryOpNamesTheOverlap) {
  constexpr int64_t T = 4, E = 4, k = 2, H = 4;
  std::vector<float> logits = ramp(T * E, 0.3f), f32(64, 0.0f);
  std::vector<int32_t> i32(64, 0);
  std::vector<int32_t> topk{0, 1, 2, 3, 1, 0, 3, 2};
  std::vector<float> x = ramp(T * H, 0.5f);
  RouteOptions ro;
  ro.k = k;
  const ConstTensorView lg(logits.data(), DType::kF32, {T, E});
  const std::vector<AliasCase> cases = {
      {"activation: a on h",
       [&] {
         return activation(ConstTensorView(x.data(), DType::kF32, {T, H}), Activation::kRelu,
                           TensorView(x.data(), DType::kF32, {T, H}));
       },
       "activation: a = at 0x"},
      {"activation_backward: d_h on d_a",
       [&] {
         return activation_backward(ConstTensorView(x.data(), DType::kF32, {T, H}),
                                    ConstTensorView(f32.data(), DType::kF32, {T, H}),
                                    Activation::kRelu, TensorView(f32.data(), DType::kF32, {T, H}));
       },
       "overlaps d_a (an input)"},
      {"route: topk_weights on probs",
       [&] {
         RouteOutputs out;
         out.probs = TensorView(f32.data(), DType::kF32, {T, E});
         out.topk_indices = TensorView(i32.data(), DType::kI32, {T, k});
         out.topk_weights = TensorView(f32.data() + 2, DType::kF32, {T, k});
         return route(lg, ro, out);
       },
       "overlaps probs (another output)"},
      {"route: topk_indices on logits",
       [&] {
         RouteOutputs out;
         out.topk_indices = TensorView(logits.data(), DType::kI32, {T, k});
         return route(lg, ro, out);
       },
       "overlaps logits (an input)"},
      {"z_loss: loss inside logits", [&] { return z_loss(lg, 1.0f, logits.data() + 5); },
       "z_loss: loss"},
      {"load_balancing_loss: loss inside the counts",
       [&] {
         LoadBalancingOptions o;
         o.k = k;
         o.coeff = 1.0f;
         return load_balancing_loss(ConstTensorView(f32.data(), DType::kF32, {T, E}),
                                    ConstTensorView(i32.data(), DType::kI32, {E}), o,
                                    reinterpret_cast<float*>(i32.data() + 1));
       },
       "overlaps tokens_per_expert"},
      {"z_loss_backward: d_logits on logits",
       [&] {
         return z_loss_backward(lg, 1.0f, 1.0f, TensorView(logits.data(), DType::kF32, {T, E}));
       },
       "overlaps logits"},
      {"permute: row_map on tokens_per_expert",
       [&] {
         PermuteOutputs out{TensorView(f32.data(), DType::kF32, {T * k, H}),
                            {},
                            TensorView(i32.data(), DType::kI32, {E}),
                            TensorView(i32.data() + 2, DType::kI32, {2, T, k}),
                            {}};
         return permute(ConstTensorView(x.data(), DType::kF32, {T, H}),
                        ConstTensorView(topk.data(), DType::kI32, {T, k}), {}, {}, out);
       },
       "out.row_map = at 0x"},
      {"permute: out.x one row into x",
       [&] {
         // x is the first T rows of f32, out.x the T * k rows from f32's second row.
         PermuteOutputs out{TensorView(f32.data() + H, DType::kF32, {T * k, H}),
                            {},
                            TensorView(i32.data(), DType::kI32, {E}),
                            TensorView(i32.data() + 8, DType::kI32, {2, T, k}),
                            {}};
         return permute(ConstTensorView(f32.data(), DType::kF32, {T, H}),
                        ConstTensorView(topk.data(), DType::kI32, {T, k}), {}, {}, out);
       },
       "overlaps x (an input)"},
      {"sort_chunks_by_index: out on x",
       [&] {
         const int32_t split[] = {2, 2}, index[] = {1, 0};
         return sort_chunks_by_index(ConstTensorView(x.data(), DType::kF32, {T, H}),
                                     ConstTensorView(split, DType::kI32, {2}),
                                     ConstTensorView(index, DType::kI32, {2}), false,
                                     TensorView(x.data(), DType::kF32, {T, H}));
       },
       "overlaps x"},
      {"count_tokens_per_expert: counts on the map",
       [&] {
         return count_tokens_per_expert(ConstTensorView(i32.data(), DType::kBool, {T, E}),
                                        TensorView(i32.data(), DType::kI32, {E}));
       },
       "overlaps routing_map"},
      {"update_expert_bias: bias on the counts",
       [&] {
         return update_expert_bias(ConstTensorView(i32.data(), DType::kI32, {E}), 0.1f,
                                   TensorView(i32.data(), DType::kF32, {E}));
       },
       "overlaps tokens_per_expert"},
  };
  for (const AliasCase& c : cases) {
    SCOPED_TRACE(c.what);
    const std::vector<float> f32_before = f32, x_before = x, logits_before = logits;
    const std::vector<int32_t> i32_before = i32;
    const Status s = c.call();
    EXPECT_NE(message(s).find(c.expect), std::string::npos) << message(s);
    EXPECT_NE(message(s).find("overlaps"), std::string::npos) << message(s);
    EXPECT_EQ(f32, f32_before);
    EXPECT_EQ(x, x_before);
    EXPECT_EQ(logits, logits_before);
    EXPECT_EQ(i32, i32_before);
  }
}

TEST(Aliasing, LayerOutputsApartFromInputsAndWorkspace) {
  MoeLayerConfig c;
  c.hidden = 8, c.ffn = 4, c.num_experts = 4, c.route.k = 2;
  constexpr int64_t T = 5;
  std::vector<float> x = ramp(T * 8, 0.2f), router = ramp(8 * 4, 0.1f),
                     w_in = ramp(4 * 8 * 8, 0.05f), w_out = ramp(4 * 4 * 8, 0.05f), out(T * 8);
  const MoeLayerWeights w{ConstTensorView(router.data(), DType::kF32, {8, 4}),
                          ConstTensorView(w_in.data(), DType::kF32, {4, 8, 8}),
                          ConstTensorView(w_out.data(), DType::kF32, {4, 4, 8}),
                          {},
                          {}};
  const MoeLayerWorkspace need = moe_layer_workspace(c, T, DType::kF32);
  ASSERT_GT(need.saved_bytes, 0u);
  auto* mem = static_cast<std::byte*>(
      ::operator new (need.saved_bytes + need.forward_bytes, std::align_val_t{64}));
  const std::span<std::byte> saved(mem, need.saved_bytes);
  const ConstTensorView xv(x.data(), DType::kF32, {T, 8});
  // out on x: refused; out apart: runs.
  const std::vector<float> x_before = x;
  Status s = moe_layer_forward(xv, w, c, saved, std::span<std::byte>(mem, need.forward_bytes),
                               {TensorView(x.data(), DType::kF32, {T, 8})});
  EXPECT_NE(message(s).find("out.out"), std::string::npos) << message(s);
  EXPECT_NE(message(s).find("overlaps x (an input)"), std::string::npos) << message(s);
  EXPECT_EQ(x, x_before);
  // The scratch on the saved buffer: refused.
  s = moe_layer_forward(xv, w, c, saved, std::span<std::byte>(mem, need.forward_bytes),
                        {TensorView(out.data(), DType::kF32, {T, 8})});
  EXPECT_NE(message(s).find("overlaps saved (another output)"), std::string::npos) << message(s);
  s = moe_layer_forward(xv, w, c, saved,
                        std::span<std::byte>(mem + need.saved_bytes, need.forward_bytes),
                        {TensorView(out.data(), DType::kF32, {T, 8})});
  EXPECT_TRUE(s.ok()) << message(s);
  ::operator delete (mem, std::align_val_t{64});
}

}  // namespace
}  // namespace moekit
