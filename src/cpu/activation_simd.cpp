// The expert FFN activations, vectorised: rows split over the OpenMP threads, each row walked a
// vector of f32 lanes at a time with Highway's exp and tanh. Written once with Highway and compiled
// for every x86 target it knows; the widest the CPU supports is picked at run time. A row's tail
// runs through zero-padded buffers, so that every element sees the same arithmetic and nothing
// is read or written past the row; a bf16 output is rounded once, as float_to_bf16.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/activation_simd.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Must come after foreach_target.h.
#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/activation_kernels.h"
#include "cpu/convert.h"
#include "cpu/lanes-inl.h"

HWY_BEFORE_NAMESPACE();
namespace moekit::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using D = hn::ScalableTag<float>;
using V = hn::Vec<D>;

// sigmoid(x). Below -88, exp(-x) leaves f32 (and Highway's Exp its valid range): 0 there, as
// 1 / (1 + inf), so that silu(x) = x * sigmoid(x) is 0 and not x times a tiny number.
HWY_INLINE V Sigmoid(D d, V x) {
  const V limit = hn::Set(d, 88.0f);
  const V e = hn::Exp(d, hn::Min(hn::Neg(x), limit));
  const V s = hn::Div(hn::Set(d, 1.0f), hn::Add(hn::Set(d, 1.0f), e));
  return hn::IfThenZeroElse(hn::Lt(x, hn::Neg(limit)), s);
}

// tanh(sqrt(2/pi) (x + 0.044715 x^3)) for x clamped to [-20, 20], where it is already +-1 in f32
// (the clamp keeps x^3 finite). Returns the clamped x too.
HWY_INLINE V GeluTanh(D d, V x, V* xc) {
  *xc = hn::Min(hn::Max(x, hn::Set(d, -20.0f)), hn::Set(d, 20.0f));
  const V x2 = hn::Mul(*xc, *xc);
  const V inner = hn::Mul(hn::Mul(hn::Set(d, 0.7978845608028654f), *xc),
                          hn::MulAdd(hn::Set(d, 0.044715f), x2, hn::Set(d, 1.0f)));
  return hn::Tanh(d, inner);
}

template <Activation kAct>
HWY_INLINE V ActValue(D d, V x) {
  if constexpr (kAct == Activation::kSwiGLU) {
    return hn::Mul(x, Sigmoid(d, x));
  } else if constexpr (kAct == Activation::kRelu) {
    return hn::Max(x, hn::Zero(d));
  } else {
    V xc;
    const V t = GeluTanh(d, x, &xc);
    return hn::Mul(hn::Mul(hn::Set(d, 0.5f), x), hn::Add(hn::Set(d, 1.0f), t));
  }
}

// act(x) and act'(x) together.
template <Activation kAct>
HWY_INLINE void ActValueGrad(D d, V x, V* value, V* grad) {
  const V one = hn::Set(d, 1.0f);
  if constexpr (kAct == Activation::kSwiGLU) {
    const V s = Sigmoid(d, x);
    *value = hn::Mul(x, s);
    *grad = hn::Mul(s, hn::MulAdd(x, hn::Sub(one, s), one));  // s (1 + x (1 - s))
  } else if constexpr (kAct == Activation::kRelu) {
    const auto pos = hn::Gt(x, hn::Zero(d));
    *value = hn::IfThenElseZero(pos, x);
    *grad = hn::IfThenElseZero(pos, one);
  } else {
    V xc;
    const V t = GeluTanh(d, x, &xc);
    const V half = hn::Set(d, 0.5f);
    const V x2 = hn::Mul(xc, xc);
    // 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
    const V poly =
        hn::Mul(hn::Set(d, 0.7978845608028654f), hn::MulAdd(hn::Set(d, 3.0f * 0.044715f), x2, one));
    const V sech2 = hn::NegMulAdd(t, t, one);
    *value = hn::Mul(hn::Mul(half, x), hn::Add(one, t));
    *grad = hn::MulAdd(hn::Mul(hn::Mul(half, xc), sech2), poly, hn::Mul(half, hn::Add(one, t)));
  }
}

// Element i of a row of bf16 bits (kBf16) or f32, as f32.
template <bool kBf16>
float LoadOne(const void* row, size_t i) {
  return kBf16 ? bf16_to_float(static_cast<const bf16_bits*>(row)[i])
               : static_cast<const float*>(row)[i];
}

// Calls body(i, r) for each vector of lanes [i, i + r) of [0, n): whole vectors, then the tail.
template <class Body>
HWY_INLINE void ForEachVector(size_t n, Body body) {
  const D d;
  const size_t N = hn::Lanes(d);
  size_t i = 0;
  for (; i + N <= n; i += N) body(i, N);
  if (i < n) body(i, n - i);
}

// Lanes [i, i + r) of a row as f32, r <= N; a partial vector through a zero-padded buffer.
template <bool kBf16>
HWY_INLINE V LoadPart(D d, const void* row, size_t i, size_t r) {
  if (r == hn::Lanes(d)) return LoadLanes<kBf16>(d, row, i);
  HWY_ALIGN float buf[HWY_MAX_BYTES / sizeof(float)] = {};
  for (size_t j = 0; j < r; ++j) buf[j] = LoadOne<kBf16>(row, i + j);
  return hn::Load(d, buf);
}

// Stores lanes [0, r) of v to [i, i + r) of a row, touching nothing past it.
template <bool kBf16>
HWY_INLINE void StorePart(D d, V v, void* row, size_t i, size_t r) {
  if (r == hn::Lanes(d)) return StoreLanes<kBf16>(d, v, row, i);
  using Out = std::conditional_t<kBf16, uint16_t, float>;
  HWY_ALIGN Out buf[HWY_MAX_BYTES / sizeof(float)];
  StoreLanes<kBf16>(d, v, buf, 0);
  std::memcpy(static_cast<Out*>(row) + i, buf, r * sizeof(Out));
}

template <Activation kAct, bool kHBf16, bool kOutBf16>
void ForwardRows(const ActivationProblem& p) {
  const D d;
  const size_t F = static_cast<size_t>(p.F);
  const size_t h_es = kHBf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (p.N * p.F >= (1 << 16))
  for (int64_t r = 0; r < p.N; ++r) {
    const char* h = row_ptr(p.h, r);
    const char* up = h + F * h_es;
    char* a = row_ptr(p.out, r);
    ForEachVector(F, [&](size_t i, size_t n) {
      V v = ActValue<kAct>(d, LoadPart<kHBf16>(d, h, i, n));
      if constexpr (is_gated(kAct)) v = hn::Mul(v, LoadPart<kHBf16>(d, up, i, n));
      StorePart<kOutBf16>(d, v, a, i, n);
    });
  }
}

template <Activation kAct, bool kHBf16, bool kDaBf16, bool kOutBf16>
void BackwardRows(const ActivationProblem& p) {
  const D d;
  const size_t F = static_cast<size_t>(p.F);
  const size_t h_es = kHBf16 ? 2 : 4, out_es = kOutBf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (p.N * p.F >= (1 << 16))
  for (int64_t r = 0; r < p.N; ++r) {
    const char* h = row_ptr(p.h, r);
    const char* da = row_ptr(p.d_a, r);
    char* dh = row_ptr(p.out, r);
    ForEachVector(F, [&](size_t i, size_t n) {
      V value, grad;
      ActValueGrad<kAct>(d, LoadPart<kHBf16>(d, h, i, n), &value, &grad);
      const V g = LoadPart<kDaBf16>(d, da, i, n);
      if constexpr (is_gated(kAct)) {
        const V u = LoadPart<kHBf16>(d, h + F * h_es, i, n);
        StorePart<kOutBf16>(d, hn::Mul(hn::Mul(g, u), grad), dh, i, n);
        StorePart<kOutBf16>(d, hn::Mul(g, value), dh + F * out_es, i, n);
      } else {
        StorePart<kOutBf16>(d, hn::Mul(g, grad), dh, i, n);
      }
    });
  }
}

// Run-time choices as template arguments: f gets an integral_constant of the value.
template <class F>
void WithActivation(Activation act, F f) {
  switch (act) {
    case Activation::kSwiGLU:
      return f(std::integral_constant<Activation, Activation::kSwiGLU>());
    case Activation::kGeGLU:
      return f(std::integral_constant<Activation, Activation::kGeGLU>());
    case Activation::kGelu:
      return f(std::integral_constant<Activation, Activation::kGelu>());
    case Activation::kRelu:
      return f(std::integral_constant<Activation, Activation::kRelu>());
  }
}
template <class F>
void WithBool(bool b, F f) {
  b ? f(std::true_type()) : f(std::false_type());
}

void Forward(const ActivationProblem& p) {
  WithActivation(p.act, [&](auto act) {
    WithBool(p.h.dtype == DType::kBF16, [&](auto h_bf16) {
      WithBool(p.out.dtype == DType::kBF16, [&](auto out_bf16) {
        ForwardRows<decltype(act)::value, decltype(h_bf16)::value, decltype(out_bf16)::value>(p);
      });
    });
  });
}

void Backward(const ActivationProblem& p) {
  WithActivation(p.act, [&](auto act) {
    WithBool(p.h.dtype == DType::kBF16, [&](auto h_bf16) {
      WithBool(p.d_a.dtype == DType::kBF16, [&](auto da_bf16) {
        WithBool(p.out.dtype == DType::kBF16, [&](auto out_bf16) {
          BackwardRows<decltype(act)::value, decltype(h_bf16)::value, decltype(da_bf16)::value,
                       decltype(out_bf16)::value>(p);
        });
      });
    });
  });
}

}  // namespace moekit::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moekit::detail {

HWY_EXPORT(Forward);
HWY_EXPORT(Backward);

Status activation_vectorized(const ActivationProblem& p) {
  HWY_DYNAMIC_DISPATCH(Forward)(p);
  return {};
}

Status activation_backward_vectorized(const ActivationProblem& p) {
  HWY_DYNAMIC_DISPATCH(Backward)(p);
  return {};
}

}  // namespace moekit::detail
#endif  // HWY_ONCE
