// The expert FFN's activation (SPEC.md section 5), forward and backward, row by row: the step
// between the layer's two grouped matmuls, public so that a caller composing the layer's steps
// (layer.h) can call it on its own. Both calls take an execution context last (moekit/exec.h): on
// CUDA buffers they run as one elementwise kernel on the stream, with the CPU's formulas in f32.
#pragma once

#include "moekit/exec.h"
#include "moekit/status.h"
#include "moekit/view.h"

namespace moekit {

// The expert FFN's nonlinearity. Gated ones take h = [gate | up] (gate in columns [0, F), up in
// [F, 2F)) and give act(gate) * up; the others map h [N, F] elementwise. GELU is the tanh form
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as jax.nn.gelu's default.
enum class Activation {
  kSwiGLU,  // silu(gate) * up, silu(x) = x * sigmoid(x)
  kGeGLU,   // gelu(gate) * up
  kGelu,    // gelu(h)
  kRelu,    // max(h, 0)
};

constexpr bool is_gated(Activation a) {
  return a == Activation::kSwiGLU || a == Activation::kGeGLU;
}

// kAuto takes the CUDA kernel on CUDA buffers and the vectorised, threaded one on host buffers;
// kReference is the CPU's scalar one the tests compare with.
enum class ActivationImpl { kAuto, kCuda, kVectorized, kReference };
// "auto", "cuda", "vectorized", "reference" ("unknown" outside the enum), as the errors say it.
const char* impl_name(ActivationImpl impl);

// a = act(h), row by row.
//   h  [N, 2F] (gated) or [N, F]   f32 | bf16
//   a  [N, F]                      f32 | h's dtype
Status activation(ConstTensorView h, Activation act, TensorView a,
                  ActivationImpl impl = ActivationImpl::kAuto, const Exec& exec = {});

// Gradient of activation: d_h = d_a * act'(h); gated: d_gate = d_a * up * act'(gate),
// d_up = d_a * act(gate). ReLU's derivative at 0 is 0.
//   h    [N, 2F] or [N, F]   f32 | bf16, as given to activation
//   d_a  [N, F]              f32 | bf16
//   d_h  like h              f32 | h's dtype
Status activation_backward(ConstTensorView h, ConstTensorView d_a, Activation act, TensorView d_h,
                           ActivationImpl impl = ActivationImpl::kAuto, const Exec& exec = {});

}  // namespace moekit
