// Scalar reference of the expert FFN activations, std:: math, one element at a time. Written to
// be read against the formulas in include/moekit/activation.h, not to be fast.
#include <cmath>

#include "cpu/activation_kernels.h"
#include "cpu/convert.h"

namespace moekit::detail {
namespace {

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluA = 0.044715f;

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

float act_value(Activation act, float x) {
  switch (act) {
    case Activation::kSwiGLU:
      return x * sigmoid(x);
    case Activation::kGeGLU:
    case Activation::kGelu:
      return 0.5f * x * (1.0f + std::tanh(kGeluC * (x + kGeluA * x * x * x)));
    case Activation::kRelu:
      return x > 0.0f ? x : 0.0f;
  }
  return 0.0f;
}

float act_grad(Activation act, float x) {
  switch (act) {
    case Activation::kSwiGLU: {
      const float s = sigmoid(x);
      return s * (1.0f + x * (1.0f - s));
    }
    case Activation::kGeGLU:
    case Activation::kGelu: {
      const float t = std::tanh(kGeluC * (x + kGeluA * x * x * x));
      return 0.5f * (1.0f + t) +
             0.5f * x * (1.0f - t * t) * kGeluC * (1.0f + 3.0f * kGeluA * x * x);
    }
    case Activation::kRelu:
      return x > 0.0f ? 1.0f : 0.0f;
  }
  return 0.0f;
}

}  // namespace

Status activation_ref(const ActivationProblem& p) {
  const bool gated = is_gated(p.act);
  for (int64_t r = 0; r < p.N; ++r) {
    const char* h = row_ptr(p.h, r);
    char* a = row_ptr(p.out, r);
    for (int64_t j = 0; j < p.F; ++j) {
      const float g = load_as_float(h, p.h.dtype, j);
      const float v = act_value(p.act, g);
      store_float(a, p.out.dtype, j, gated ? v * load_as_float(h, p.h.dtype, p.F + j) : v);
    }
  }
  return {};
}

Status activation_backward_ref(const ActivationProblem& p) {
  const bool gated = is_gated(p.act);
  for (int64_t r = 0; r < p.N; ++r) {
    const char* h = row_ptr(p.h, r);
    const char* da = row_ptr(p.d_a, r);
    char* dh = row_ptr(p.out, r);
    for (int64_t j = 0; j < p.F; ++j) {
      const float g = load_as_float(h, p.h.dtype, j);
      const float d = load_as_float(da, p.d_a.dtype, j);
      if (!gated) {
        store_float(dh, p.out.dtype, j, d * act_grad(p.act, g));
        continue;
      }
      const float u = load_as_float(h, p.h.dtype, p.F + j);
      store_float(dh, p.out.dtype, j, d * u * act_grad(p.act, g));
      store_float(dh, p.out.dtype, p.F + j, d * act_value(p.act, g));
    }
  }
  return {};
}

}  // namespace moekit::detail
