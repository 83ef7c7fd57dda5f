// Internal: rows of views, element access for f32 / bf16 buffers, and whole rows converted to f32
// and back.
#pragma once

#include <cstdint>
#include <cstring>

#include "moekit/dtype.h"
#include "moekit/view.h"

namespace moekit::detail {

// Row r of a view (rows stride[0] elements apart), as bytes: const for a ConstTensorView.
inline const char* row_ptr(const ConstTensorView& v, int64_t r) {
  return static_cast<const char*>(v.data) +
         r * v.stride[0] * static_cast<int64_t>(dtype_size(v.dtype));
}
inline char* row_ptr(const TensorView& v, int64_t r) {
  return static_cast<char*>(v.data) + r * v.stride[0] * static_cast<int64_t>(dtype_size(v.dtype));
}

// An element as f32, by its storage type (for loops templated on it).
inline float as_float(float v) { return v; }
inline float as_float(bf16_bits v) { return bf16_to_float(v); }

inline float load_as_float(const void* base, DType t, int64_t i) {
  return t == DType::kF32 ? static_cast<const float*>(base)[i]
                          : bf16_to_float(static_cast<const bf16_bits*>(base)[i]);
}
inline void store_float(void* base, DType t, int64_t i, float v) {
  if (t == DType::kF32) {
    static_cast<float*>(base)[i] = v;
  } else {
    static_cast<bf16_bits*>(base)[i] = float_to_bf16(v);
  }
}

// out[0, n) = row[0, n) as f32.
inline void load_row_as_float(const void* row, DType t, int64_t n, float* out) {
  if (t == DType::kF32) {
    std::memcpy(out, row, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  const auto* b = static_cast<const bf16_bits*>(row);
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(b[i]);
}
// row[0, n) = in[0, n) in the row's dtype (bf16 rounded to nearest even).
inline void store_row_from_float(const float* in, int64_t n, void* row, DType t) {
  if (t == DType::kF32) {
    std::memcpy(row, in, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  auto* b = static_cast<bf16_bits*>(row);
  for (int64_t i = 0; i < n; ++i) b[i] = float_to_bf16(in[i]);
}

}  // namespace moekit::detail
