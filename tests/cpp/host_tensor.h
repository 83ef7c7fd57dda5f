// Test helper: an owning host tensor that hands out moekit views.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <new>
#include <random>
#include <vector>

#include "moekit/dtype.h"
#include "moekit/view.h"

namespace moekit {

// Storage aligned to 64 bytes, as a framework's buffers are: the kernels' aligned paths (whole
// vectors, non-temporal stores) then run; padded rows (row_pad) reach the unaligned ones.
template <typename T>
struct Aligned64Allocator {
  using value_type = T;
  Aligned64Allocator() = default;
  template <typename U>
  Aligned64Allocator(const Aligned64Allocator<U>&) {}  // NOLINT(google-explicit-constructor)
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new (n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, size_t) { ::operator delete (p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const Aligned64Allocator<U>&) const {
    return true;
  }
};

// A host tensor of any moekit dtype with optional row padding. fill_random draws bf16-exact
// values, so that products are exact in f32 and the only rounding the tests see is accumulation
// order and the output dtype.
struct HostTensor {
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // elements; innermost 1
  std::vector<std::byte, Aligned64Allocator<std::byte>> bytes;

  HostTensor(DType t, std::vector<int64_t> dims, int64_t row_pad = 0) : dtype(t), shape(dims) {
    strides.assign(dims.size(), 1);
    for (int d = static_cast<int>(dims.size()) - 2; d >= 0; --d) {
      strides[d] =
          dims[d + 1] * strides[d + 1] + (d == static_cast<int>(dims.size()) - 2 ? row_pad : 0);
    }
    bytes.resize(std::max<int64_t>(span(), 1) * dtype_size(t));
  }
  // Elements from the first to one past the last (0 for an empty tensor, whose buffer still
  // holds one element so that its data pointer is not null).
  int64_t span() const { return shape.empty() ? 1 : shape[0] * strides[0]; }
  int64_t offset(std::initializer_list<int64_t> idx) const {
    int64_t o = 0, d = 0;
    for (int64_t i : idx) o += i * strides[d++];
    return o;
  }
  double get(std::initializer_list<int64_t> idx) const { return get_flat(offset(idx)); }
  void set(std::initializer_list<int64_t> idx, double v) { set_flat(offset(idx), v); }
  double get_flat(int64_t o) const {
    switch (dtype) {
      case DType::kF32:
        return reinterpret_cast<const float*>(bytes.data())[o];
      case DType::kBF16:
        return bf16_to_float(reinterpret_cast<const bf16_bits*>(bytes.data())[o]);
      case DType::kI32:
        return reinterpret_cast<const int32_t*>(bytes.data())[o];
      case DType::kBool:
        return static_cast<double>(reinterpret_cast<const uint8_t*>(bytes.data())[o]);
      case DType::kF16:
        return static_cast<double>(reinterpret_cast<const _Float16*>(bytes.data())[o]);
    }
    return 0;
  }
  void set_flat(int64_t o, double v) {
    switch (dtype) {
      case DType::kF32:
        reinterpret_cast<float*>(bytes.data())[o] = static_cast<float>(v);
        break;
      case DType::kBF16:
        reinterpret_cast<bf16_bits*>(bytes.data())[o] = float_to_bf16(static_cast<float>(v));
        break;
      case DType::kI32:
        reinterpret_cast<int32_t*>(bytes.data())[o] = static_cast<int32_t>(v);
        break;
      case DType::kBool:
        reinterpret_cast<uint8_t*>(bytes.data())[o] = static_cast<uint8_t>(v);
        break;
      case DType::kF16:  // f32 first, then round to nearest even, as a device would
        reinterpret_cast<_Float16*>(bytes.data())[o] = static_cast<_Float16>(static_cast<float>(v));
        break;
    }
  }
  // Every element of the buffer, padding included.
  void fill_random(std::mt19937& rng) {
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (int64_t i = 0; i < static_cast<int64_t>(bytes.size() / dtype_size(dtype)); ++i) {
      set_flat(i, bf16_to_float(float_to_bf16(u(rng))));
    }
  }
  void fill(float v) {
    for (int64_t i = 0; i < static_cast<int64_t>(bytes.size() / dtype_size(dtype)); ++i) {
      set_flat(i, v);
    }
  }
  template <typename View>
  View view() {
    View v;
    v.data = bytes.data();
    v.dtype = dtype;
    v.rank = static_cast<int>(shape.size());
    for (int d = 0; d < v.rank; ++d) v.shape[d] = shape[d], v.stride[d] = strides[d];
    return v;
  }
  TensorView mut() { return view<TensorView>(); }
  ConstTensorView in() { return view<TensorView>(); }
};

// A copy of a rank-3 tensor [A, B, C] laid out [A, C, B] (each matrix transposed), as a
// weight [E, K, n] stored [E, n, K].
inline HostTensor transposed_matrices(const HostTensor& t) {
  HostTensor out(t.dtype, {t.shape[0], t.shape[2], t.shape[1]});
  for (int64_t a = 0; a < t.shape[0]; ++a) {
    for (int64_t b = 0; b < t.shape[1]; ++b) {
      for (int64_t c = 0; c < t.shape[2]; ++c) out.set({a, c, b}, t.get({a, b, c}));
    }
  }
  return out;
}

// Group sizes for `groups` groups summing to `total`: each row lands in a group drawn uniformly.
inline std::vector<int32_t> random_sizes(std::mt19937& rng, int64_t groups, int64_t total) {
  std::vector<int32_t> s(groups, 0);
  std::uniform_int_distribution<int64_t> pick(0, groups - 1);
  for (int64_t i = 0; i < total; ++i) ++s[pick(rng)];
  return s;
}

}  // namespace moekit
