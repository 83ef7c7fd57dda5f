// Internal: the activation problem after validation (src/activation.cpp), as every implementation
// takes it: the CPU's (cpu/activation_kernels.h) and the CUDA one (cuda/activation_cuda.h).
#pragma once

#include <cstdint>

#include "moekit/activation.h"
#include "moekit/exec.h"

namespace moekit::detail {

struct ActivationProblem {
  ConstTensorView h;    // [N, 2F] gated | [N, F]
  ConstTensorView d_a;  // [N, F]; backward only
  TensorView out;       // forward: a [N, F]; backward: d_h like h
  Activation act = Activation::kSwiGLU;
  int64_t N = 0, F = 0;
  Exec exec;
};

}  // namespace moekit::detail
