// The expert FFN activation on CUDA (activation_cuda.h): activation_math.h's formulas (the CPU
// reference's), one thread per 8 elements of a row (or per element
// where the rows are not aligned for 16-byte words), the rows over the grid's y.
#include <cuda_runtime.h>

#include <cstdint>

#include "activation_math.h"
#include "cuda/activation_cuda.h"
#include "cuda/launch.cuh"
#include "cuda/rows.cuh"

namespace moekit::detail::cuda {
namespace {

using act::grad;
using act::value;

struct ActArgs {
  Mat h, d_a, out;
  int64_t N, F;
  Activation act;
  bool gated;
};

// a = act(gate) * up (gated) or act(h).
template <int V>
__global__ void __launch_bounds__(kElementwiseThreads) activation_kernel(ActArgs a) {
  MOEKIT_FOR_EACH_ELEMENTS(r, j, a.N, a.F, V) {
    float g[V], out[V];
    load_elems(a.h.row(r), a.h.t, j, g);
    if (a.gated) {
      float u[V];
      load_elems(a.h.row(r), a.h.t, a.F + j, u);
#pragma unroll
      for (int i = 0; i < V; ++i) out[i] = value(a.act, g[i]) * u[i];
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) out[i] = value(a.act, g[i]);
    }
    store_elems(a.out.row(r), a.out.t, j, out);
  }
}

// d_h = d_a * act'(h); gated: d_gate = d_a * up * act'(gate), d_up = d_a * act(gate).
template <int V>
__global__ void __launch_bounds__(kElementwiseThreads) activation_backward_kernel(ActArgs a) {
  MOEKIT_FOR_EACH_ELEMENTS(r, j, a.N, a.F, V) {
    float g[V], d[V], dg[V];
    load_elems(a.h.row(r), a.h.t, j, g);
    load_elems(a.d_a.row(r), a.d_a.t, j, d);
    if (a.gated) {
      float u[V], du[V];
      load_elems(a.h.row(r), a.h.t, a.F + j, u);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        dg[i] = d[i] * u[i] * grad(a.act, g[i]);
        du[i] = d[i] * value(a.act, g[i]);
      }
      store_elems(a.out.row(r), a.out.t, a.F + j, du);
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) dg[i] = d[i] * grad(a.act, g[i]);
    }
    store_elems(a.out.row(r), a.out.t, j, dg);
  }
}

template <class Kernel8, class Kernel1>
Status launch(const char* op, const ActivationProblem& p, Kernel8 k8, Kernel1 k1) {
  if (p.N == 0 || p.F == 0) return {};
  const ActArgs a{Mat(p.h), Mat(p.d_a), Mat(p.out), p.N, p.F, p.act, is_gated(p.act)};
  launch_elementwise(rows_aligned({a.h, a.d_a, a.out}, p.F), p.N, p.F, p.exec.stream, k8, k1, a);
  return launch_status(op, "the kernel");
}

}  // namespace

Status activation_cuda(const ActivationProblem& p) {
  return launch("activation", p, activation_kernel<8>, activation_kernel<1>);
}

Status activation_backward_cuda(const ActivationProblem& p) {
  return launch("activation_backward", p, activation_backward_kernel<8>,
                activation_backward_kernel<1>);
}

}  // namespace moekit::detail::cuda
