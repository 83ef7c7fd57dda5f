// Scalar reference of the expert FFN activations, one element at a time through the formulas of
// activation_math.h. Written to be read against include/moekit/activation.h, not to be fast.
#include "activation_math.h"
#include "cpu/activation_kernels.h"
#include "cpu/convert.h"

namespace moekit::detail {

using act::grad;
using act::value;

Status activation_ref(const ActivationProblem& p) {
  const bool gated = is_gated(p.act);
  for (int64_t r = 0; r < p.N; ++r) {
    const char* h = row_ptr(p.h, r);
    char* a = row_ptr(p.out, r);
    for (int64_t j = 0; j < p.F; ++j) {
      const float g = load_as_float(h, p.h.dtype, j);
      const float v = value(p.act, g);
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
        store_float(dh, p.out.dtype, j, d * grad(p.act, g));
        continue;
      }
      const float u = load_as_float(h, p.h.dtype, p.F + j);
      store_float(dh, p.out.dtype, j, d * u * grad(p.act, g));
      store_float(dh, p.out.dtype, p.F + j, d * value(p.act, g));
    }
  }
  return {};
}

}  // namespace moekit::detail
