// The expert FFN activations' formulas (include/moekit/activation.h), one element in f32: the
// CPU's scalar reference (cpu/activation_ref.cpp) and the CUDA kernel (cuda/activation.cu) both
// compute these, so that the two say the same thing by construction. expf and tanhf are the C
// library's on the host and CUDA's on the device.
#pragma once

#include <cmath>

#include "moekit/activation.h"

#ifdef __CUDACC__
#define MOEKIT_HOST_DEVICE __host__ __device__
#else
#define MOEKIT_HOST_DEVICE
#endif

namespace moekit::detail::act {

inline constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)
inline constexpr float kGeluA = 0.044715f;

MOEKIT_HOST_DEVICE inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// act(x); GeLU is the tanh form.
MOEKIT_HOST_DEVICE inline float value(Activation act, float x) {
  switch (act) {
    case Activation::kSwiGLU:
      return x * sigmoid(x);
    case Activation::kGeGLU:
    case Activation::kGelu:
      return 0.5f * x * (1.0f + tanhf(kGeluC * (x + kGeluA * x * x * x)));
    case Activation::kRelu:
      return x > 0.0f ? x : 0.0f;
  }
  return 0.0f;
}

// act'(x); ReLU's at 0 is 0.
MOEKIT_HOST_DEVICE inline float grad(Activation act, float x) {
  switch (act) {
    case Activation::kSwiGLU: {
      const float s = sigmoid(x);
      return s * (1.0f + x * (1.0f - s));
    }
    case Activation::kGeGLU:
    case Activation::kGelu: {
      const float t = tanhf(kGeluC * (x + kGeluA * x * x * x));
      return 0.5f * (1.0f + t) +
             0.5f * x * (1.0f - t * t) * kGeluC * (1.0f + 3.0f * kGeluA * x * x);
    }
    case Activation::kRelu:
      return x > 0.0f ? 1.0f : 0.0f;
  }
  return 0.0f;
}

}  // namespace moekit::detail::act
