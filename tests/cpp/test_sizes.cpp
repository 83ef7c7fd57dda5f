// Views whose element count, element offsets or byte offsets do not fit 64 bits (issue 22): every
// op refuses them with a named error before it writes anything, instead of wrapping a size and
// reading or writing wrapped memory. The data pointers are real but tiny: a call that went on
// would fault under ASan, or at once.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "moekit/layer.h"
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

}  // namespace
}  // namespace moekit
