// Internal: the two CPU implementations of the activation problem (activation_problem.h): a
// scalar reference (activation_ref.cpp) and a vectorised, threaded one (activation_simd.cpp).
#pragma once

#include <cstdint>

#include "activation_problem.h"
#include "moekit/activation.h"

namespace moekit::detail {

Status activation_ref(const ActivationProblem& p);
Status activation_backward_ref(const ActivationProblem& p);
Status activation_vectorized(const ActivationProblem& p);
Status activation_backward_vectorized(const ActivationProblem& p);

}  // namespace moekit::detail
