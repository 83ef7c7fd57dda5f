// Public entry points of the expert FFN activation: validate, then run the first implementation
// of the table that takes the call (the CUDA kernel for CUDA buffers where moekit is built with
// it, the vectorised CPU code, the scalar reference last).
#include "moekit/activation.h"

#include <string>

#include "check.h"
#include "cpu/activation_kernels.h"
#include "impl_table.h"
#if MOEKIT_HAS_CUDA
#include "cuda/activation_cuda.h"
#endif

namespace moekit {
namespace {

using detail::ActivationProblem;
using detail::check_dim;
using detail::check_input_dtype;
using detail::check_output_dtype;
using detail::check_view;
using detail::Implementation;
using detail::kCpuNeeds;
using detail::kCudaNeeds;
using detail::on_cpu;
using detail::on_cuda;

constexpr Implementation<ActivationImpl, ActivationProblem> kForwardImpls[] = {
#if MOEKIT_HAS_CUDA
    {ActivationImpl::kCuda, detail::cuda::activation_cuda, on_cuda, kCudaNeeds},
#endif
    {ActivationImpl::kVectorized, detail::activation_vectorized, on_cpu, kCpuNeeds},
    {ActivationImpl::kReference, detail::activation_ref, on_cpu, kCpuNeeds},
};
constexpr Implementation<ActivationImpl, ActivationProblem> kBackwardImpls[] = {
#if MOEKIT_HAS_CUDA
    {ActivationImpl::kCuda, detail::cuda::activation_backward_cuda, on_cuda, kCudaNeeds},
#endif
    {ActivationImpl::kVectorized, detail::activation_backward_vectorized, on_cpu, kCpuNeeds},
    {ActivationImpl::kReference, detail::activation_backward_ref, on_cpu, kCpuNeeds},
};

// h [N, 2F | F] and the activation; fills p.act, p.h, p.N, p.F.
Status check_h(const char* op, ConstTensorView h, Activation act, ActivationProblem& p) {
  if (act != Activation::kSwiGLU && act != Activation::kGeGLU && act != Activation::kGelu &&
      act != Activation::kRelu) {
    return Status::invalid_argument(op, "act", std::to_string(static_cast<int>(act)),
                                    "not an Activation");
  }
  MOEKIT_RETURN_IF_ERROR(check_view(op, "h", h, 2));
  MOEKIT_RETURN_IF_ERROR(check_input_dtype(op, "h", h.dtype));
  if (is_gated(act) && h.shape[1] % 2 != 0) {
    return Status::invalid_argument(op, "h.shape[1]", std::to_string(h.shape[1]),
                                    "a gated activation needs [gate | up], an even width");
  }
  p.act = act;
  p.h = h;
  p.N = h.shape[0];
  p.F = is_gated(act) ? h.shape[1] / 2 : h.shape[1];
  return {};
}

}  // namespace

Status activation(ConstTensorView h, Activation act, TensorView a, ActivationImpl impl,
                  const Exec& exec) {
  constexpr const char* op = "activation";
  MOEKIT_RETURN_IF_ERROR(detail::check_exec(op, exec));
  ActivationProblem p;
  p.exec = exec;
  MOEKIT_RETURN_IF_ERROR(check_h(op, h, act, p));
  MOEKIT_RETURN_IF_ERROR(check_view(op, "a", a, 2));
  MOEKIT_RETURN_IF_ERROR(check_output_dtype(op, "a", a.dtype, h.dtype));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "a", a, 0, p.N, "h.shape[0]"));
  MOEKIT_RETURN_IF_ERROR(
      check_dim(op, "a", a, 1, p.F, is_gated(act) ? "h.shape[1] / 2" : "h.shape[1]"));
  p.out = a;
  MOEKIT_RETURN_IF_ERROR(detail::check_disjoint(op, {{"a", a}}, {{"h", h}}));
  return detail::run_implementation(op, kForwardImpls, impl, p);
}

Status activation_backward(ConstTensorView h, ConstTensorView d_a, Activation act, TensorView d_h,
                           ActivationImpl impl, const Exec& exec) {
  constexpr const char* op = "activation_backward";
  MOEKIT_RETURN_IF_ERROR(detail::check_exec(op, exec));
  ActivationProblem p;
  p.exec = exec;
  MOEKIT_RETURN_IF_ERROR(check_h(op, h, act, p));
  MOEKIT_RETURN_IF_ERROR(check_view(op, "d_a", d_a, 2));
  MOEKIT_RETURN_IF_ERROR(check_input_dtype(op, "d_a", d_a.dtype));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "d_a", d_a, 0, p.N, "h.shape[0]"));
  MOEKIT_RETURN_IF_ERROR(
      check_dim(op, "d_a", d_a, 1, p.F, is_gated(act) ? "h.shape[1] / 2" : "h.shape[1]"));
  MOEKIT_RETURN_IF_ERROR(check_view(op, "d_h", d_h, 2));
  MOEKIT_RETURN_IF_ERROR(check_output_dtype(op, "d_h", d_h.dtype, h.dtype));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "d_h", d_h, 0, p.N, "h.shape[0]"));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, "d_h", d_h, 1, h.shape[1], "h.shape[1]"));
  p.d_a = d_a;
  p.out = d_h;
  MOEKIT_RETURN_IF_ERROR(detail::check_disjoint(op, {{"d_h", d_h}}, {{"h", h}, {"d_a", d_a}}));
  return detail::run_implementation(op, kBackwardImpls, impl, p);
}

const char* impl_name(ActivationImpl impl) {
  switch (impl) {
    case ActivationImpl::kAuto:
      return "auto";
    case ActivationImpl::kCuda:
      return "cuda";
    case ActivationImpl::kVectorized:
      return "vectorized";
    case ActivationImpl::kReference:
      return "reference";
  }
  return "unknown";
}

}  // namespace moekit
