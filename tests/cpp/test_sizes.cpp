// Views whose element count, element offsets or byte offsets do not fit 64 bits (issue 22): every
// op refuses them with a named error before it writes anything, instead of wrapping a size and
// reading or writing wrapped memory. The data pointers are real but tiny: a call that went on
// would fault under ASan, or at once.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "moekit/layer.h"
#include "moekit/permute.h"
#include "moekit/ragged_dot.h"

namespace moekit {
namespace {

constexpr int64_t k2p32 = int64_t{1} << 32;

// A view over `data` (16 floats) that claims the given shape and strides.
TensorView claim(float* data, const std::vector<int64_t>& shape,
                 const std::vector<int64_t>& stride) {
  TensorView v;
  v.data = data;
  v.rank = static_cast<int>(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    v.shape[d] = shape[d];
    v.stride[d] = stride[d];
  }
  return v;
}

struct BadView {
  const char* what;
  std::vector<int64_t> shape, stride;
  const char* message;
};

// Each bad in its own way, each with a non-null pointer and a non-zero element count.
std::vector<BadView> bad_views() {
  return {
      // 2^64 elements: the count wraps to 0, which once passed as "empty".
      {"count wraps to 0", {k2p32, k2p32}, {k2p32, 1}, "more elements than a 64-bit count holds"},
      {"count past int64", {int64_t{1} << 62, 4}, {4, 1}, "more elements than a 64-bit count"},
      // A row stride whose offsets wrap.
      {"row stride wraps", {4, 4}, {int64_t{1} << 62, 1}, "offsets past 64 bits"},
      // 2^62 f32 elements fit a count, not a byte offset.
      {"bytes past int64", {int64_t{1} << 60, 4}, {4, 1}, "past 64-bit byte offsets"},
  };
}

std::string failure(const Status& s) { return s.ok() ? "ok" : s.message(); }

TEST(Sizes, RaggedDotRefusesViewsThatDoNotFit64Bits) {
  std::vector<float> lhs(16, 1.0f), rhs(16, 1.0f), out(16, 7.0f);
  const int32_t groups[] = {2};
  for (const BadView& b : bad_views()) {
    SCOPED_TRACE(b.what);
    const TensorView bad = claim(lhs.data(), b.shape, b.stride);
    const Status s = ragged_dot(bad, TensorView(rhs.data(), DType::kF32, {1, 4, 4}), groups,
                                TensorView(out.data(), DType::kF32, {4, 4}));
    EXPECT_NE(failure(s).find("lhs"), std::string::npos) << failure(s);
    EXPECT_NE(failure(s).find(b.message), std::string::npos) << failure(s);
    // As the result, too.
    const Status o = ragged_dot(TensorView(lhs.data(), DType::kF32, {2, 4}),
                                TensorView(rhs.data(), DType::kF32, {1, 4, 4}), groups,
                                claim(out.data(), b.shape, b.stride));
    EXPECT_NE(failure(o).find("out"), std::string::npos) << failure(o);
    EXPECT_NE(failure(o).find(b.message), std::string::npos) << failure(o);
    for (float v : out) ASSERT_EQ(v, 7.0f) << "written before the error";
  }
}

TEST(Sizes, ActivationRefusesViewsThatDoNotFit64Bits) {
  std::vector<float> h(16, 1.0f), a(16, 7.0f);
  for (const BadView& b : bad_views()) {
    SCOPED_TRACE(b.what);
    const Status s = activation(claim(h.data(), b.shape, b.stride), Activation::kRelu,
                                TensorView(a.data(), DType::kF32, {4, 4}));
    EXPECT_NE(failure(s).find("h"), std::string::npos) << failure(s);
    EXPECT_NE(failure(s).find(b.message), std::string::npos) << failure(s);
    const Status o = activation(TensorView(h.data(), DType::kF32, {4, 4}), Activation::kRelu,
                                claim(a.data(), b.shape, b.stride));
    EXPECT_NE(failure(o).find(b.message), std::string::npos) << failure(o);
    for (float v : a) ASSERT_EQ(v, 7.0f) << "written before the error";
  }
}

TEST(Sizes, ViewsThatFitStillRun) {
  // The checks refuse only what does not fit: a padded row stride is fine.
  std::vector<float> h(16, -1.0f), a(16, 7.0f);
  h[0] = 2.0f;
  ASSERT_TRUE(activation(claim(h.data(), {2, 4}, {8, 1}), Activation::kRelu,
                         TensorView(a.data(), DType::kF32, {2, 4}))
                  .ok());
  EXPECT_EQ(a[0], 2.0f);
  EXPECT_EQ(a[1], 0.0f);
}

// A small permute: T = 5 tokens, k = 2 of E = 3 experts, H = 2; the outputs sized by N rows.
struct SmallPermute {
  static constexpr int64_t T = 5, k = 2, E = 3, H = 2;
  std::vector<int32_t> topk{0, 1, 1, 2, 0, 2, 1, 0, 2, 1};
  std::vector<float> x, probs;
  std::vector<float> x_perm, probs_perm;
  std::vector<int32_t> tokens_per_expert = std::vector<int32_t>(E, -7);
  std::vector<int32_t> row_map = std::vector<int32_t>(2 * T * k, -7);

  explicit SmallPermute(int64_t N) : x_perm(N * H, -7.0f), probs_perm(N, -7.0f) {
    for (int64_t i = 0; i < T * H; ++i) x.push_back(static_cast<float>(i + 1));
    for (int64_t i = 0; i < T * k; ++i) probs.push_back(0.1f * static_cast<float>(i + 1));
  }
  Status run(const PermuteOptions& o) {
    const int64_t N = static_cast<int64_t>(probs_perm.size());
    return permute(TensorView(x.data(), DType::kF32, {T, H}),
                   TensorView(topk.data(), DType::kI32, {T, k}),
                   TensorView(probs.data(), DType::kF32, {T, k}), o,
                   {TensorView(x_perm.data(), DType::kF32, {N, H}),
                    TensorView(probs_perm.data(), DType::kF32, {N}),
                    TensorView(tokens_per_expert.data(), DType::kI32, {E}),
                    TensorView(row_map.data(), DType::kI32, {2, T, k}),
                    {}});
  }
};

TEST(Sizes, HugeCapacityFactorKeepsEverySlotOrIsRefusedPadded) {
  // ceil(T * k / E * cf) does not fit int64 for these (1e19 once overflowed a conversion).
  SmallPermute dropless(10);
  ASSERT_TRUE(dropless.run({}).ok());
  for (double cf : {1e19, 1e300}) {
    SCOPED_TRACE(cf);
    PermuteOptions o;
    o.capacity_factor = cf;
    SmallPermute kept(10);
    ASSERT_TRUE(kept.run(o).ok()) << failure(kept.run(o));
    EXPECT_EQ(kept.x_perm, dropless.x_perm);
    EXPECT_EQ(kept.row_map, dropless.row_map);
    EXPECT_EQ(kept.tokens_per_expert, dropless.tokens_per_expert);
    // Padded to that capacity, no block fits i32 rows: refused, nothing written.
    o.pad_to_capacity = true;
    EXPECT_EQ(permute_max_rows(SmallPermute::T, SmallPermute::E, SmallPermute::k, o), -1);
    SmallPermute padded(10);
    const Status s = padded.run(o);
    EXPECT_NE(failure(s).find("must be indexable by i32"), std::string::npos) << failure(s);
    EXPECT_EQ(padded.x_perm, std::vector<float>(10 * SmallPermute::H, -7.0f));
    EXPECT_EQ(padded.tokens_per_expert, std::vector<int32_t>(SmallPermute::E, -7));
  }
}

TEST(Sizes, AlignSizeBeyondI32RowsIsRefused) {
  for (int64_t a : {int64_t{1} << 31, int64_t{1} << 40, INT64_MAX}) {
    SCOPED_TRACE(a);
    PermuteOptions o;
    o.align_size = a;
    EXPECT_EQ(permute_max_rows(5, 3, 2, o), -1);
    SmallPermute p(10);
    const Status s = p.run(o);
    EXPECT_NE(failure(s).find("align_size"), std::string::npos) << failure(s);
    EXPECT_EQ(p.row_map, std::vector<int32_t>(2 * SmallPermute::T * SmallPermute::k, -7));
  }
}

TEST(Sizes, PermuteMaxRowsIsTheBoundOrMinusOne) {
  // Small sizes: the documented formulas.
  PermuteOptions o;
  EXPECT_EQ(permute_max_rows(5, 3, 2, o), 10);
  o.align_size = 4;
  EXPECT_EQ(permute_max_rows(5, 3, 2, o), (10 + 3 * 3) / 4 * 4);
  o.capacity_factor = 1.0;  // capacity ceil(10 / 3) = 4, aligned 4
  EXPECT_EQ(permute_max_rows(5, 3, 2, o), std::min<int64_t>(3 * 4, (10 + 3 * 3) / 4 * 4));
  o.pad_to_capacity = true;
  EXPECT_EQ(permute_max_rows(5, 3, 2, o), 3 * 4);
  // Bounds past i32 rows, and products past int64 (they once wrapped to 0 or small values).
  PermuteOptions none;
  EXPECT_EQ(permute_max_rows(int64_t{1} << 30, 8, 2, none), -1);  // 2^31 rows
  EXPECT_EQ(permute_max_rows((int64_t{1} << 31) - 1, 8, 1, none), (int64_t{1} << 31) - 1);
  EXPECT_EQ(permute_max_rows(int64_t{1} << 62, 8, 8, none), -1);
  EXPECT_EQ(permute_max_rows(INT64_MAX, 1, INT32_MAX, none), -1);
  PermuteOptions aligned;
  aligned.align_size = INT32_MAX;
  EXPECT_EQ(permute_max_rows(1, INT32_MAX, 1, aligned), -1);
  EXPECT_EQ(permute_max_rows(1, int64_t{1} << 31, 1, none), -1);  // experts past i32
  EXPECT_EQ(permute_max_rows(-1, 8, 1, none), -1);
}

TEST(Sizes, LayerWorkspacePastSizeTIsAnInvalidConfig) {
  MoeLayerConfig c;
  c.hidden = 64, c.ffn = 32, c.num_experts = 8, c.route.k = 2;
  const MoeLayerWorkspace fits = moe_layer_workspace(c, 100, DType::kBF16);
  EXPECT_GT(fits.saved_bytes, size_t{100 * 64 * 2});
  EXPECT_GT(fits.forward_bytes, 0u);
  EXPECT_GT(fits.backward_bytes, 0u);
  // [N, H] with N = 2^31 - 2 rows and H = 2^31 - 1: 2^64 bytes, past size_t (it once came back
  // wrapped); and sizes past int32, refused as such.
  for (auto [H, F] :
       {std::pair{int64_t{INT32_MAX}, int64_t{32}}, std::pair{int64_t{64}, int64_t{INT32_MAX}},
        std::pair{int64_t{1} << 40, int64_t{32}}, std::pair{int64_t{1} << 62, int64_t{1} << 62}}) {
    SCOPED_TRACE(H);
    c.hidden = H, c.ffn = F;
    const MoeLayerWorkspace w = moe_layer_workspace(c, (int64_t{1} << 30) - 1, DType::kF32);
    EXPECT_EQ(w.saved_bytes, 0u);
    EXPECT_EQ(w.forward_bytes, 0u);
    EXPECT_EQ(w.backward_bytes, 0u);
    EXPECT_EQ(moe_layer_rows(c, (int64_t{1} << 30) - 1), -1);
  }
}

TEST(Sizes, RaggedDotFlopsNeverReadsPastTheGroups) {
  const std::vector<int32_t> sizes{3, 0, 5, 2};
  EXPECT_EQ(ragged_dot_flops(sizes, 1, 2, 7, 11), 2 * 5 * 7 * 11);
  EXPECT_EQ(ragged_dot_flops(sizes, 3, 4, 7, 11), 2 * 2 * 7 * 11);  // past the end: 0 rows
  EXPECT_EQ(ragged_dot_flops(sizes, 9, 1, 7, 11), 0);
  EXPECT_EQ(ragged_dot_flops(sizes, 0, INT64_MAX, 7, 11), 2 * 10 * 7 * 11);
  // A negative offset once read before the groups.
  EXPECT_EQ(ragged_dot_flops(sizes, -2, 4, 7, 11), -1);
  EXPECT_EQ(ragged_dot_flops(sizes, 0, -1, 7, 11), -1);
  EXPECT_EQ(ragged_dot_flops(sizes, 0, 4, -7, 11), -1);
  EXPECT_EQ(ragged_dot_flops(std::vector<int32_t>{3, -1}, 0, 2, 7, 11), -1);
  EXPECT_EQ(ragged_dot_flops(sizes, 0, 4, int64_t{1} << 40, int64_t{1} << 40), -1);
}

}  // namespace
}  // namespace moekit
