// Element types and the bf16 <-> f32 conversions every backend and test shares.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace moekit {

// kBool is one byte holding 0 or 1 (the routing map). kF16 (IEEE half) is taken by the CUDA
// backend's ragged_dot only.
enum class DType : uint8_t { kF32, kBF16, kI32, kBool, kF16 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kBool:
      return 1;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kI32:
      return "i32";
    case DType::kBool:
      return "bool";
    case DType::kF16:
      return "f16";
  }
  return "?";
}

// bf16 is stored as its 16 bits: the top half of an IEEE f32.
using bf16_bits = uint16_t;

constexpr float bf16_to_float(bf16_bits b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

// Round to nearest, ties to even (what oneDNN, CUDA and JAX do); NaN stays a quiet NaN.
constexpr bf16_bits float_to_bf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_bits>((u >> 16) | 0x0040u);
  const uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16_bits>((u + rounding_bias) >> 16);
}

}  // namespace moekit
