// Vector row kernels for the permutation ops: the weighted sum of a token's rows (combine), the
// dot products of several rows with one (the merging-probs gradient) and a scaled row. Both walk
// the rows side by side, a few cache lines of each at a time, so that the k rows a token gathers
// from all over the permuted buffer stream in together (the hardware prefetchers follow each) and
// the sums stay in registers. Written once with Highway and compiled for every x86 target it knows;
// the widest the CPU supports is picked at run time. Sums run in f32 in slot order; bf16 rows widen
// exactly and a bf16 output is rounded once, to nearest even, NaN kept quiet (as float_to_bf16).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/permute_simd.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Must come after foreach_target.h.
#include <hwy/highway.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/lanes-inl.h"
#include "cpu/permute_kernels.h"

HWY_BEFORE_NAMESPACE();
namespace moekit::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using D = hn::ScalableTag<float>;
using V = hn::Vec<D>;

// Vectors per step of a row: two cache lines of bf16, four of f32 on AVX-512.
constexpr size_t kUnroll = 4;

// acc[u] = 0 + the sum over j < n, in order, of w[j] * load(j, u) (w absent: 1), for u <
// kUnroll; load(j, u) is lanes [u * N, (u + 1) * N) of the block's part of row j. Starting from
// +0 as the reference and XLA's reductions do: a lone -0 product sums to +0.
template <class Load>
HWY_INLINE void SumBlock(D d, const float* w, size_t n, V* acc, Load load) {
  for (size_t u = 0; u < kUnroll; ++u) acc[u] = hn::Zero(d);
  for (size_t j = 0; j < n; ++j) {
    const V wj = hn::Set(d, w ? w[j] : 1.0f);
    for (size_t u = 0; u < kUnroll; ++u) acc[u] = hn::MulAdd(wj, load(j, u), acc[u]);
  }
}

template <bool kIn, bool kOut>
void CombineTyped(const void* const* rows, const float* w, size_t n, size_t H, void* out) {
  const D d;
  const size_t N = hn::Lanes(d), step = kUnroll * N;
  V acc[kUnroll];
  size_t i = 0;
  for (; i + step <= H; i += step) {
    SumBlock(d, w, n, acc,
             [&](size_t j, size_t u) { return LoadLanes<kIn>(d, rows[j], i + u * N); });
    for (size_t u = 0; u < kUnroll; ++u) StoreLanes<kOut>(d, acc[u], out, i + u * N);
  }
  if (i == H) return;
  // The tail: each row's last r elements copied into a zero-padded block as it is reached,
  // summed the same way.
  using In = std::conditional_t<kIn, uint16_t, float>;
  using Out = std::conditional_t<kOut, uint16_t, float>;
  HWY_ALIGN In block[kUnroll * HWY_MAX_BYTES / sizeof(float)] = {};
  HWY_ALIGN Out result[kUnroll * HWY_MAX_BYTES / sizeof(float)];
  const size_t r = H - i;
  SumBlock(d, w, n, acc, [&](size_t j, size_t u) {
    if (u == 0) std::memcpy(block, static_cast<const In*>(rows[j]) + i, r * sizeof(In));
    return LoadLanes<kIn>(d, block, u * N);
  });
  for (size_t u = 0; u < kUnroll; ++u) StoreLanes<kOut>(d, acc[u], result, u * N);
  std::memcpy(static_cast<Out*>(out) + i, result, r * sizeof(Out));
}

// out[0, H) = w * g[0, H), f32 or rounded to bf16; kStream: the whole vectors with non-temporal
// stores (out aligned to a vector of its type).
template <bool kOut, bool kStream>
void ScaleTyped(const float* g, float w, size_t H, void* out) {
  const V wv = hn::Set(D(), w);
  StoreRow<kOut, kStream>(g, H, out, [wv](V v) { return hn::Mul(wv, v); });
}

void ScaleRow(const float* g, float w, size_t H, void* out, bool out_bf16, bool stream) {
  // Non-temporal stores only where every whole vector of the row is aligned for them.
  if (stream && StreamAligned(out, out_bf16 ? sizeof(uint16_t) : sizeof(float))) {
    out_bf16 ? ScaleTyped<true, true>(g, w, H, out) : ScaleTyped<false, true>(g, w, H, out);
  } else {
    out_bf16 ? ScaleTyped<true, false>(g, w, H, out) : ScaleTyped<false, false>(g, w, H, out);
  }
}

// out[j] = <rows[j], g> over [0, H), j < M, the M rows read side by side in one pass over g, a
// vector of partial sums per row.
template <size_t M, bool kIn>
void DotGroup(const void* const* rows, const float* g, size_t H, float* out) {
  const D d;
  const size_t N = hn::Lanes(d);
  V acc[M];
  for (size_t j = 0; j < M; ++j) acc[j] = hn::Zero(d);
  size_t i = 0;
  for (; i + N <= H; i += N) {
    const V gv = hn::LoadU(d, g + i);
    for (size_t j = 0; j < M; ++j) acc[j] = hn::MulAdd(LoadLanes<kIn>(d, rows[j], i), gv, acc[j]);
  }
  if (i < H) {
    // The tail through zero-padded copies of g and of each row.
    using In = std::conditional_t<kIn, uint16_t, float>;
    HWY_ALIGN float g_tail[HWY_MAX_BYTES / sizeof(float)] = {};
    HWY_ALIGN In row_tail[HWY_MAX_BYTES / sizeof(float)] = {};
    std::memcpy(g_tail, g + i, (H - i) * sizeof(float));
    const V gv = hn::Load(d, g_tail);
    for (size_t j = 0; j < M; ++j) {
      std::memcpy(row_tail, static_cast<const In*>(rows[j]) + i, (H - i) * sizeof(In));
      acc[j] = hn::MulAdd(LoadLanes<kIn>(d, row_tail, 0), gv, acc[j]);
    }
  }
  for (size_t j = 0; j < M; ++j) out[j] = hn::GetLane(hn::SumOfLanes(d, acc[j]));
}

template <bool kIn>
void DotTyped(const void* const* rows, size_t n, const float* g, size_t H, float* out) {
  using Group = void (*)(const void* const*, const float*, size_t, float*);
  static constexpr Group kGroups[] = {
      DotGroup<1, kIn>, DotGroup<2, kIn>, DotGroup<3, kIn>, DotGroup<4, kIn>,
      DotGroup<5, kIn>, DotGroup<6, kIn>, DotGroup<7, kIn>, DotGroup<8, kIn>,
  };
  constexpr size_t kMax = sizeof(kGroups) / sizeof(kGroups[0]);
  for (size_t j = 0; j < n; j += kMax) {
    kGroups[std::min(kMax, n - j) - 1](rows + j, g, H, out + j);
  }
}

void DotRows(const void* const* rows, size_t n, bool rows_bf16, const float* g, size_t H,
             float* out) {
  rows_bf16 ? DotTyped<true>(rows, n, g, H, out) : DotTyped<false>(rows, n, g, H, out);
}

void CombineRows(const void* const* rows, const float* w, size_t n, bool rows_bf16, size_t H,
                 void* out, bool out_bf16) {
  if (rows_bf16) {
    out_bf16 ? CombineTyped<true, true>(rows, w, n, H, out)
             : CombineTyped<true, false>(rows, w, n, H, out);
  } else {
    out_bf16 ? CombineTyped<false, true>(rows, w, n, H, out)
             : CombineTyped<false, false>(rows, w, n, H, out);
  }
}

}  // namespace moekit::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moekit::detail {

HWY_EXPORT(CombineRows);
HWY_EXPORT(DotRows);
HWY_EXPORT(ScaleRow);

void combine_rows(const void* const* rows, const float* w, int64_t n, DType rows_t, int64_t H,
                  void* out, DType out_t) {
  HWY_DYNAMIC_DISPATCH(CombineRows)
  (rows, w, static_cast<size_t>(n), rows_t == DType::kBF16, static_cast<size_t>(H), out,
   out_t == DType::kBF16);
}

void dot_rows(const void* const* rows, int64_t n, DType rows_t, const float* g, int64_t H,
              float* out) {
  HWY_DYNAMIC_DISPATCH(DotRows)
  (rows, static_cast<size_t>(n), rows_t == DType::kBF16, g, static_cast<size_t>(H), out);
}

void scale_row(const float* g, float w, int64_t H, void* out, DType out_t, bool stream) {
  HWY_DYNAMIC_DISPATCH(ScaleRow)(g, w, static_cast<size_t>(H), out, out_t == DType::kBF16, stream);
}

}  // namespace moekit::detail
#endif  // HWY_ONCE
