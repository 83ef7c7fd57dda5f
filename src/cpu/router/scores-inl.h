// Internal, Highway: the router's element-wise score functions on one vector of f32, shared by
// the row kernels (row_ops.cpp) and the token-lane forward (token_blocks.cpp), so that a score
// is the same bits whichever layout computed it. Included after hwy/foreach_target.h, once per
// target.
#if defined(MOEKIT_CPU_ROUTER_SCORES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MOEKIT_CPU_ROUTER_SCORES_INL_H_
#undef MOEKIT_CPU_ROUTER_SCORES_INL_H_
#else
#define MOEKIT_CPU_ROUTER_SCORES_INL_H_
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

// e^(-|x|), in [0, 1].
HWY_INLINE V ExpNegAbs(D d, V x) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  // Highway's Exp for arguments in [-104, 0] (its reduction by ln 2 and its polynomial), with q
  // rounded to nearest and 2^q applied by one scalef instead of two exponent-field products:
  // 11 vector ops fewer, and within an ulp of Exp. Below -104 the result is 0, as Exp's; a NaN's
  // is 0 too (the Max keeps the bound), as Exp's path gives.
  const V a = hn::Max(hn::Neg(hn::Abs(x)), hn::Set(d, -104.0f));
  const V qf = hn::Round(hn::Mul(a, hn::Set(d, 1.442695040888963407359924681f)));
  V r = hn::MulAdd(qf, hn::Set(d, -0.693145751953125f), a);
  r = hn::MulAdd(qf, hn::Set(d, -1.428606765330187045e-6f), r);
  const V p = hn::MulAdd(
      hn::impl::Estrin(
          r, hn::Set(d, +0.5f), hn::Set(d, +0.166666671633720397949219f),
          hn::Set(d, +0.0416664853692054748535156f), hn::Set(d, +0.00833336077630519866943359f),
          hn::Set(d, +0.00139304355252534151077271f), hn::Set(d, +0.000198527617612853646278381f)),
      hn::Mul(r, r), r);
  const V y = V{_mm512_scalef_ps(hn::Add(p, hn::Set(d, 1.0f)).raw, qf.raw)};
  return hn::IfThenZeroElse(hn::Le(a, hn::Set(d, -104.0f)), y);
#else
  return hn::Exp(d, hn::Max(hn::Neg(hn::Abs(x)), hn::Set(d, -FLT_MAX)));
#endif
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
