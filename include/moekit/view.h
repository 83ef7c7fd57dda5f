// Non-owning tensor views: a data pointer, a dtype, a shape and strides in elements. The
// innermost dimension must be contiguous (stride 1) for every op; outer strides are free, so a
// view can name a block of rows of a larger buffer.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "moekit/dtype.h"

namespace moekit {

inline constexpr int kMaxRank = 4;

template <bool kMutable>
struct BasicView {
  using Pointer = std::conditional_t<kMutable, void*, const void*>;

  Pointer data = nullptr;
  DType dtype = DType::kF32;
  int rank = 0;
  std::array<int64_t, kMaxRank> shape{};
  std::array<int64_t, kMaxRank> stride{};  // in elements

  BasicView() = default;
  // A contiguous row-major view.
  BasicView(Pointer p, DType t, std::initializer_list<int64_t> dims) : data(p), dtype(t) {
    rank = static_cast<int>(dims.size());
    int i = 0;
    for (int64_t d : dims) shape[i++] = d;
    // A stride past int64 (a shape whose elements cannot be addressed) saturates; every op
    // refuses such a view (check_view) before using it.
    int64_t s = 1;
    for (int d = rank - 1; d >= 0; --d) {
      stride[d] = s;
      if (d > 0 && __builtin_mul_overflow(s, shape[d], &s)) s = INT64_MAX;
    }
  }
  // A mutable view converts to a const one.
  template <bool kOther, typename = std::enable_if_t<!kMutable && kOther>>
  BasicView(const BasicView<kOther>& o)  // NOLINT(google-explicit-constructor)
      : data(o.data), dtype(o.dtype), rank(o.rank), shape(o.shape), stride(o.stride) {}

  // The element count; INT64_MAX when it does not fit (ops refuse such a view).
  int64_t numel() const {
    int64_t n = 1;
    bool wrapped = false;
    for (int d = 0; d < rank; ++d) {
      if (shape[d] == 0) return 0;
      wrapped |= __builtin_mul_overflow(n, shape[d], &n);
    }
    return wrapped ? INT64_MAX : n;
  }
  // Same view with a different stride for dimension `dim` (e.g. a row stride wider than a row).
  BasicView with_stride(int dim, int64_t s) const {
    BasicView v = *this;
    v.stride[dim] = s;
    return v;
  }
};

using TensorView = BasicView<true>;
using ConstTensorView = BasicView<false>;

}  // namespace moekit
