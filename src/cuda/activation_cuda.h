// Internal: the CUDA implementation of the activation problem (activation_problem.h), in
// cuda/activation.cu: one elementwise kernel each way, the reference's formulas in f32, 16-byte
// loads and stores where the rows are aligned for them. Included by activation.cpp (host
// compiler): no CUDA header.
#pragma once

#include "activation_problem.h"
#include "moekit/status.h"

namespace moekit::detail::cuda {

Status activation_cuda(const ActivationProblem& p);
Status activation_backward_cuda(const ActivationProblem& p);

}  // namespace moekit::detail::cuda
