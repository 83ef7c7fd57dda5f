// Internal (nvcc only): the device side that the CUDA ops of the router, the permutation, the
// activation and the layer share: a matrix as the kernels address it, elements of any float
// dtype as f32, the elementwise kernels' loop and launch, warp reductions, and the ranking rule
// of router.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>

#include "moekit/dtype.h"
#include "moekit/view.h"

namespace moekit::detail::cuda {

inline constexpr int kWarp = 32;
inline constexpr unsigned kFullMask = 0xffffffffu;

// A [rows, cols] matrix as a kernel reads it: a byte pointer, the bytes between rows (of the two
// innermost dimensions) and the dtype. A vector [n] is the matrix [n, 1]: element i is
// row(i)[0]. Null p: absent.
struct Mat {
  char* p = nullptr;
  int64_t ld = 0;  // bytes
  DType t = DType::kF32;

  Mat() = default;
  template <bool kMutable>
  explicit Mat(const BasicView<kMutable>& v)
      : p(static_cast<char*>(const_cast<void*>(static_cast<const void*>(v.data)))),
        ld(v.rank >= 1
               ? v.stride[v.rank >= 2 ? v.rank - 2 : 0] * static_cast<int64_t>(dtype_size(v.dtype))
               : 0),
        t(v.dtype) {}

  __device__ bool present() const { return p != nullptr; }
  template <class T = char>
  __device__ T* row(int64_t r) const {
    return reinterpret_cast<T*>(p + r * ld);
  }
};

// Element c of a row of f32, bf16 (or f16) as f32, and back (rounded to nearest even).
__device__ inline float load_float(const char* row, DType t, int64_t c) {
  switch (t) {
    case DType::kBF16:
      return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row)[c]);
    case DType::kF16:
      return __half2float(reinterpret_cast<const __half*>(row)[c]);
    default:
      return reinterpret_cast<const float*>(row)[c];
  }
}
__device__ inline void store_float(char* row, DType t, int64_t c, float v) {
  switch (t) {
    case DType::kBF16:
      reinterpret_cast<__nv_bfloat16*>(row)[c] = __float2bfloat16_rn(v);
      break;
    case DType::kF16:
      reinterpret_cast<__half*>(row)[c] = __float2half_rn(v);
      break;
    default:
      reinterpret_cast<float*>(row)[c] = v;
  }
}
// Element (r, c) of `from` to (r2, c2) of `to`, a matrix of the same dtype, bit for bit (a NaN's
// payload too: a round trip through f32 would make every bf16 NaN 0x7fff).
__device__ inline void copy_elem(const Mat& from, int64_t r, int64_t c, const Mat& to, int64_t r2,
                                 int64_t c2) {
  switch (from.t) {
    case DType::kBF16:
    case DType::kF16:
      to.row<uint16_t>(r2)[c2] = from.row<const uint16_t>(r)[c];
      break;
    default:
      to.row<uint32_t>(r2)[c2] = from.row<const uint32_t>(r)[c];
  }
}
__device__ inline float load_float(const Mat& m, int64_t r, int64_t c) {
  return load_float(m.row(r), m.t, c);
}
__device__ inline void store_float(const Mat& m, int64_t r, int64_t c, float v) {
  store_float(m.row(r), m.t, c, v);
}

// V = 8 consecutive elements of an f32 or bf16 row from element h on as f32 (16-byte words: the
// caller checked the alignment), or V = 1 element of any float dtype; and back.
template <int V>
__device__ inline void load_elems(const char* row, DType t, int64_t h, float (&f)[V]) {
  if constexpr (V == 8) {
    if (t == DType::kBF16) {
      const int4 w = *reinterpret_cast<const int4*>(row + h * 2);
      const auto* b = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 x = __bfloat1622float2(b[i]);
        f[2 * i] = x.x;
        f[2 * i + 1] = x.y;
      }
    } else {
      const auto* q = reinterpret_cast<const float4*>(row + h * 4);
      const float4 a = q[0], b = q[1];
      f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
      f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
    }
  } else {
    f[0] = load_float(row, t, h);
  }
}

template <int V>
__device__ inline void store_elems(char* row, DType t, int64_t h, const float (&f)[V]) {
  if constexpr (V == 8) {
    if (t == DType::kBF16) {
      int4 w;
      auto* b = reinterpret_cast<__nv_bfloat162*>(&w);
#pragma unroll
      for (int i = 0; i < 4; ++i) b[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
      *reinterpret_cast<int4*>(row + h * 2) = w;
    } else {
      auto* q = reinterpret_cast<float4*>(row + h * 4);
      q[0] = make_float4(f[0], f[1], f[2], f[3]);
      q[1] = make_float4(f[4], f[5], f[6], f[7]);
    }
  } else {
    store_float(row, t, h, f[0]);
  }
}

// Whether every row of these matrices starts on a 16-byte boundary (base and row pitch) and
// holds whole groups of 8 elements: the V = 8 paths.
inline bool rows_aligned(std::initializer_list<Mat> mats, int64_t H) {
  if (H % 8 != 0) return false;
  for (const Mat& m : mats) {
    if (m.p != nullptr && (reinterpret_cast<uintptr_t>(m.p) % 16 != 0 || m.ld % 16 != 0)) {
      return false;
    }
  }
  return true;
}

// Elementwise kernels over [rows, cols] (the activation, the layer's row sums and roundings):
// kElementwiseThreads threads a block, each V = 8 consecutive elements of a row where every row
// is aligned for it (rows_aligned), else V = 1; the rows over the grid's y, the columns over its
// x. MOEKIT_FOR_EACH_ELEMENTS is the loop of one thread; launch_elementwise picks V and the grid.
inline constexpr int kElementwiseThreads = 256;

#define MOEKIT_FOR_EACH_ELEMENTS(r, j, rows, cols, V)                                     \
  for (int64_t r = blockIdx.y; r < (rows); r += gridDim.y)                                \
    for (int64_t j = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * (V); \
         j < (cols); j += static_cast<int64_t>(gridDim.x) * blockDim.x * (V))

// k8 (V = 8) where `wide`, else k1, with the argument block `args`, on `stream`; rows and cols
// at least 1.
template <class Args, class K8, class K1>
void launch_elementwise(bool wide, int64_t rows, int64_t cols, cudaStream_t stream, K8 k8, K1 k1,
                        const Args& args) {
  const int64_t per_block = int64_t{kElementwiseThreads} * (wide ? 8 : 1);
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((cols + per_block - 1) / per_block, 64)),
                  static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
  if (wide) {
    k8<<<grid, kElementwiseThreads, 0, stream>>>(args);
  } else {
    k1<<<grid, kElementwiseThreads, 0, stream>>>(args);
  }
}

// The widest word (16, 8, 4, 2 or 1 bytes) that divides every base, every row pitch and the
// row's bytes: calls f with a value of its type.
template <class F>
inline void with_word(std::initializer_list<Mat> mats, int64_t row_bytes, F f) {
  uint64_t bits = static_cast<uint64_t>(row_bytes);
  for (const Mat& m : mats) {
    if (m.p != nullptr) bits |= reinterpret_cast<uintptr_t>(m.p) | static_cast<uint64_t>(m.ld);
  }
  if (bits % 16 == 0) return f(int4{});
  if (bits % 8 == 0) return f(uint2{});
  if (bits % 4 == 0) return f(uint32_t{});
  if (bits % 2 == 0) return f(uint16_t{});
  f(char{});
}

// Element i of an i32 vector, and a value stored into one, held to i32's range.
__device__ inline int32_t load_int(const Mat& m, int64_t i) { return *m.row<const int32_t>(i); }
__device__ inline void store_int(const Mat& m, int64_t i, int64_t v) {
  *m.row<int32_t>(i) =
      static_cast<int32_t>(v > INT32_MAX ? INT32_MAX : (v < INT32_MIN ? INT32_MIN : v));
}

__device__ inline float warp_sum(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}
__device__ inline double warp_sum(double v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}
// The largest number (NaN ignored; -inf when there is none).
__device__ inline float warp_max(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// router.h's ranking: larger first, NaN after every number (-inf too), NaNs equal.
__device__ inline bool before(float a, float b) { return !isnan(a) && (isnan(b) || a > b); }

// A candidate of a selection: its key and its index (e < 0: none).
struct Pick {
  float key;
  int32_t e;
};
// Whether a ranks ahead of b: by key (before), ties to the lower index; none after everything.
__device__ inline bool ahead(Pick a, Pick b) {
  if (a.e < 0) return false;
  if (b.e < 0) return true;
  if (before(a.key, b.key)) return true;
  if (before(b.key, a.key)) return false;
  return a.e < b.e;
}
// The best of the warp's 32 picks, on every lane (a total order over distinct indices).
__device__ inline Pick warp_best(Pick p) {
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const Pick q{__shfl_xor_sync(kFullMask, p.key, o), __shfl_xor_sync(kFullMask, p.e, o)};
    if (ahead(q, p)) p = q;
  }
  return p;
}

}  // namespace moekit::detail::cuda
