// Internal: the expert FFN activation after validation (src/activation.cpp), and its two CPU
// implementations: a scalar reference (activation_ref.cpp) and a vectorised, threaded one
// (activation_simd.cpp).
#pragma once

#include <cstdint>

#include "moekit/activation.h"

namespace moekit::detail {

struct ActivationProblem {
  ConstTensorView h;    // [N, 2F] gated | [N, F]
  ConstTensorView d_a;  // [N, F]; backward only
  TensorView out;       // forward: a [N, F]; backward: d_h like h
  Activation act = Activation::kSwiGLU;
  int64_t N = 0, F = 0;
};

Status activation_ref(const ActivationProblem& p);
Status activation_backward_ref(const ActivationProblem& p);
Status activation_vectorized(const ActivationProblem& p);
Status activation_backward_vectorized(const ActivationProblem& p);

}  // namespace moekit::detail
