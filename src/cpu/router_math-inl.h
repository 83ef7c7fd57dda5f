// Internal, Highway: the router's element-wise score functions on one vector of f32, shared by
// the row kernels (router_simd.cpp) and the token-lane forward (router_lanes.cpp), so that a score
// is the same bits whichever layout computed it. Included after hwy/foreach_target.h, once per
// target.
#if defined(MOEKIT_CPU_ROUTER_MATH_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MOEKIT_CPU_ROUTER_MATH_INL_H_
#undef MOEKIT_CPU_ROUTER_MATH_INL_H_
#else
#define MOEKIT_CPU_ROUTER_MATH_INL_H_
#endif

#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include <cfloat>

HWY_BEFORE_NAMESPACE();
namespace moekit::detail::HWY_NAMESPACE {
namespace rmath {
namespace hn = hwy::HWY_NAMESPACE;
using D = hn::ScalableTag<float>;
using V = hn::Vec<D>;

// e^(v - shift); -inf and huge negative differences clamp to the range Highway's Exp is exact on.
HWY_INLINE V ExpShifted(D d, V v, V shift) {
  return hn::Exp(d, hn::Max(hn::Sub(v, shift), hn::Set(d, -FLT_MAX)));
}

// e^(-|x|), in (0, 1].
HWY_INLINE V ExpNegAbs(D d, V x) {
  return hn::Exp(d, hn::Max(hn::Neg(hn::Abs(x)), hn::Set(d, -FLT_MAX)));
}

// sigmoid(x) = 1 / (1 + e^-x) for x >= 0, e^x / (1 + e^x) below: no overflow either way.
HWY_INLINE V Sigmoid(D d, V x) {
  const V e = ExpNegAbs(d, x);
  const V r = hn::Div(hn::Set(d, 1.0f), hn::Add(hn::Set(d, 1.0f), e));
  return hn::IfThenElse(hn::Ge(x, hn::Zero(d)), r, hn::Mul(e, r));
}

// sqrt(softplus(x)), softplus(x) = max(x, 0) + log1p(e^-|x|): exact for large |x| of either sign.
HWY_INLINE V SqrtSoftplus(D d, V x) {
  return hn::Sqrt(hn::Add(hn::Max(x, hn::Zero(d)), hn::Log1p(d, ExpNegAbs(d, x))));
}

}  // namespace rmath
}  // namespace moekit::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard
