// Internal, Highway: f32 lanes loaded from and stored to rows of f32 or bf16, with one rounding
// to bf16 shared by every kernel that writes bf16 (nearest even, NaN kept quiet, as
// float_to_bf16). Included by the kernel files after hwy/foreach_target.h, once per target.
#if defined(MOEKIT_CPU_LANES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MOEKIT_CPU_LANES_INL_H_
#undef MOEKIT_CPU_LANES_INL_H_
#else
#define MOEKIT_CPU_LANES_INL_H_
#endif

#include <hwy/highway.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

HWY_BEFORE_NAMESPACE();
namespace moekit::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

namespace lanes {
using D = hn::ScalableTag<float>;
using V = hn::Vec<D>;
using DU = hn::RebindToUnsigned<D>;
using DI = hn::RebindToSigned<D>;
using D16 = hn::Rebind<uint16_t, D>;  // a vector's worth of bf16 bits
}  // namespace lanes

// Lanes [i, i + N) of a row of f32 (kBf16 false) or bf16 bits, as f32.
template <bool kBf16>
HWY_INLINE lanes::V LoadLanes(lanes::D d, const void* row, size_t i) {
  if constexpr (kBf16) {
    const auto bits =
        hn::PromoteTo(lanes::DU(), hn::LoadU(lanes::D16(), static_cast<const uint16_t*>(row) + i));
    return hn::BitCast(d, hn::ShiftLeft<16>(bits));
  } else {
    return hn::LoadU(d, static_cast<const float*>(row) + i);
  }
}

// v as a vector of bf16 bits, rounded to nearest even, NaN kept quiet.
HWY_INLINE hn::Vec<lanes::D16> RoundToBf16(lanes::V v) {
  const lanes::DU du;
  const auto u = hn::BitCast(du, v);
  const auto odd = hn::And(hn::ShiftRight<16>(u), hn::Set(du, 1u));
  const auto rounded = hn::ShiftRight<16>(hn::Add(u, hn::Add(hn::Set(du, 0x7fffu), odd)));
  const auto quiet_nan = hn::Or(hn::ShiftRight<16>(u), hn::Set(du, 0x0040u));
  const auto bits = hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(v)), quiet_nan, rounded);
  return hn::DemoteTo(lanes::D16(), hn::BitCast(lanes::DI(), bits));
}

// Stores v to lanes [i, i + N) of a row of f32 or bf16 bits; kStream: with a non-temporal store,
// which needs the lanes aligned to their vector's size.
template <bool kBf16, bool kStream = false>
HWY_INLINE void StoreLanes(lanes::D d, lanes::V v, void* row, size_t i) {
  if constexpr (kBf16) {
    // Highway's Stream writes a whole 16-byte register even for a narrower vector, such as the
    // 8 bytes of bf16 that SSE4's 4 lanes make: those take a plain store.
    constexpr bool kCanStream = hn::MaxLanes(lanes::D16()) * sizeof(uint16_t) >= 16;
    auto* p = static_cast<uint16_t*>(row) + i;
    if constexpr (kStream && kCanStream) {
      hn::Stream(RoundToBf16(v), lanes::D16(), p);
    } else {
      hn::StoreU(RoundToBf16(v), lanes::D16(), p);
    }
  } else {
    auto* p = static_cast<float*>(row) + i;
    kStream ? hn::Stream(v, d, p) : hn::StoreU(v, d, p);
  }
}

// dst[0, n) = op(src[0, n)) vector by vector, f32 or rounded to bf16; kStream: the whole vectors
// with non-temporal stores (dst aligned to a vector of its type). The tail goes through
// zero-padded buffers, reading and writing only its n % N elements. With kBf16, dst may be src
// (each vector is read before its narrower result lands at or below it).
template <bool kBf16, bool kStream, class Op>
HWY_INLINE void StoreRow(const float* src, size_t n, void* dst, Op op) {
  const lanes::D d;
  const size_t N = hn::Lanes(d);
  size_t i = 0;
  for (; i + N <= n; i += N) StoreLanes<kBf16, kStream>(d, op(hn::LoadU(d, src + i)), dst, i);
  if (i == n) return;
  using Out = std::conditional_t<kBf16, uint16_t, float>;
  HWY_ALIGN float in[HWY_MAX_BYTES / sizeof(float)] = {};
  HWY_ALIGN Out out[HWY_MAX_BYTES / sizeof(float)];
  std::memcpy(in, src + i, (n - i) * sizeof(float));
  StoreLanes<kBf16>(d, op(hn::Load(d, in)), out, 0);
  std::memcpy(static_cast<Out*>(dst) + i, out, (n - i) * sizeof(Out));
}

// Whether every whole vector of a row at p, of elements `elem_bytes` wide with a vector's worth
// of f32 lanes each, is aligned for non-temporal stores.
HWY_INLINE bool StreamAligned(const void* p, size_t elem_bytes) {
  return reinterpret_cast<uintptr_t>(p) % (hn::Lanes(lanes::D()) * elem_bytes) == 0;
}

}  // namespace moekit::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MOEKIT_CPU_LANES_INL_H_
