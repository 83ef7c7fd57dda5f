// The steps every CUDA grouped GEMM shares (plan.cuh): the zero kernels, and the cached
// properties of the device.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <limits>

#include "cuda/grouped_gemm_cuda.h"
#include "cuda/plan.cuh"

namespace moekit::detail::cuda {
namespace {

constexpr int kZeroThreads = 256;

// Zeroes `bytes` bytes at p with the block's threads, in words of type W.
template <class W>
__device__ void zero_words(char* p, int64_t bytes) {
  auto* w = reinterpret_cast<W*>(p);
  for (int64_t i = threadIdx.x; i < bytes / static_cast<int64_t>(sizeof(W)); i += blockDim.x) {
    w[i] = W{};
  }
}

// Zeroes `bytes` bytes at p with the widest stores that p and bytes allow (16 bytes on aligned
// rows; 4 or 2 on the rows of unaligned widths, as an f32 or a 2-byte element).
__device__ void zero_bytes(char* p, int64_t bytes) {
  const auto fit = reinterpret_cast<uintptr_t>(p) | static_cast<uintptr_t>(bytes);
  if (fit % 16 == 0) return zero_words<int4>(p, bytes);
  if (fit % 4 == 0) return zero_words<int32_t>(p, bytes);
  if (fit % 2 == 0) return zero_words<int16_t>(p, bytes);
  zero_words<char>(p, bytes);
}

// Rows [0, begin) and [end, m) of c, taken as one list of m - (end - begin) rows of row_words
// words W, row_pitch bytes apart: the grid's threads take the list's words in order, consecutive
// threads consecutive words of a row, so that the short rows of a narrow output keep every thread
// storing (a block a row left 160 of 256 threads idle on 1.5 KiB rows).
template <class W>
__global__ void __launch_bounds__(kZeroThreads)
    zero_outside_kernel(char* c, int64_t row_pitch, int64_t row_words, int64_t m,
                        const int64_t* bounds) {
  const int64_t begin = bounds[0], end = bounds[1];
  const int64_t words = (m - (end - begin)) * row_words;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < words; i += stride) {
    const int64_t v = i / row_words;
    const int64_t r = v < begin ? v : v + (end - begin);
    reinterpret_cast<W*>(c + r * row_pitch)[i - v * row_words] = W{};
  }
}

template <class W>
Status zero_outside(const char* op, char* c, int64_t row_pitch, int64_t row_bytes, int64_t m,
                    const int64_t* bounds, cudaStream_t stream) {
  const int64_t row_words = row_bytes / static_cast<int64_t>(sizeof(W));
  const int64_t blocks = std::min<int64_t>((m * row_words + kZeroThreads - 1) / kZeroThreads, 4096);
  zero_outside_kernel<W><<<static_cast<unsigned>(blocks), kZeroThreads, 0, stream>>>(
      c, row_pitch, row_words, m, bounds);
  return launch_status(op, "the kernel zeroing non-local rows");
}

// blockIdx.y strides over the local groups, blockIdx.x over the rows of an empty group's matrix.
__global__ void __launch_bounds__(kZeroThreads)
    zero_empty_kernel(char* c, int64_t batch_pitch, int64_t row_pitch, int64_t row_bytes, int64_t p,
                      int64_t num_local, const int64_t* rows) {
  for (int64_t j = blockIdx.y; j < num_local; j += gridDim.y) {
    if (rows[j] != 0) continue;
    for (int64_t i = blockIdx.x; i < p; i += gridDim.x) {
      zero_bytes(c + j * batch_pitch + i * row_pitch, row_bytes);
    }
  }
}

}  // namespace

Status zero_uncovered(const char* op, const RowGroupedGemm& g, int64_t, const Plan& plan,
                      cudaStream_t stream) {
  if (g.m == 0 || g.n == 0) return {};
  const auto e = static_cast<int64_t>(dtype_size(g.out_type));
  auto* c = static_cast<char*>(g.c);
  const int64_t pitch = g.ldc * e, row_bytes = g.n * e;
  // The widest words that the base, the pitch and the row's bytes allow (16 bytes on aligned rows;
  // an element on the rows of unaligned widths).
  const auto fit = reinterpret_cast<uintptr_t>(c) | static_cast<uintptr_t>(pitch | row_bytes);
  if (fit % 16 == 0) return zero_outside<int4>(op, c, pitch, row_bytes, g.m, plan.bounds, stream);
  if (fit % 4 == 0) return zero_outside<int32_t>(op, c, pitch, row_bytes, g.m, plan.bounds, stream);
  return zero_outside<int16_t>(op, c, pitch, row_bytes, g.m, plan.bounds, stream);
}

Status zero_uncovered(const char* op, const ContractionGroupedGemm& g, int64_t num_local,
                      const Plan& plan, cudaStream_t stream) {
  if (num_local == 0 || g.p == 0 || g.q == 0) return {};
  const auto e = static_cast<int64_t>(dtype_size(g.out_type));
  const dim3 grid(static_cast<unsigned>(g.p < 64 ? g.p : 64),
                  static_cast<unsigned>(num_local < 65535 ? num_local : 65535));
  zero_empty_kernel<<<grid, kZeroThreads, 0, stream>>>(
      static_cast<char*>(g.c), g.c_batch * e, g.ldc * e, g.q * e, g.p, num_local, plan.rows);
  return launch_status(op, "the kernel zeroing empty groups");
}

Status device_info(DeviceInfo* out) {
  // Packed (arch << 48 | sm_count << 32 | mem_gbps) per device; 0 until read.
  static std::array<std::atomic<uint64_t>, kMaxCachedDevices> cache{};
  int device = 0;
  MOEKIT_RETURN_IF_ERROR(cuda_status("ragged_dot", "cudaGetDevice", cudaGetDevice(&device)));
  uint64_t packed = device < kMaxCachedDevices ? cache[device].load(std::memory_order_relaxed) : 0;
  if (packed == 0) {
    const auto attribute = [device](cudaDeviceAttr what, int* value) {
      return cuda_status("ragged_dot", "cudaDeviceGetAttribute",
                         cudaDeviceGetAttribute(value, what, device));
    };
    int major = 0, minor = 0, sms = 0, mem_khz = 0, bus_bits = 0;
    MOEKIT_RETURN_IF_ERROR(attribute(cudaDevAttrComputeCapabilityMajor, &major));
    MOEKIT_RETURN_IF_ERROR(attribute(cudaDevAttrComputeCapabilityMinor, &minor));
    MOEKIT_RETURN_IF_ERROR(attribute(cudaDevAttrMultiProcessorCount, &sms));
    // The bandwidth only steers kAuto's schedule: a device that does not report it reads 0 (and
    // the error is cleared, not left for the next launch's check).
    if (cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess) {
      (void)cudaGetLastError();
      mem_khz = bus_bits = 0;
    }
    // Double data rate: two transfers of bus_bits a clock.
    const uint64_t gbps =
        2 * static_cast<uint64_t>(mem_khz) * static_cast<uint64_t>(bus_bits) / 8 / 1000000;
    packed = (static_cast<uint64_t>(major * 10 + minor) << 48) |
             (static_cast<uint64_t>(static_cast<uint16_t>(sms)) << 32) |
             static_cast<uint32_t>(gbps);
    if (device < kMaxCachedDevices) cache[device].store(packed, std::memory_order_relaxed);
  }
  *out =
      DeviceInfo{device, static_cast<int>(packed >> 48), static_cast<int>((packed >> 32) & 0xffffu),
                 static_cast<int>(packed & 0xffffffffu)};
  return {};
}

// bf16 or f16 inputs; 16-byte aligned pointers; strides that are multiples of 8 elements (a
// 16-byte aligned row for 2-byte inputs, and for f32 outputs too); GEMM extents in [8, 2^31)
// and multiples of 8 (CUTLASS's problem sizes are int; K = 0 and n = 0 take the portable path).
bool tensor_core_eligible(DType in, std::initializer_list<const void*> pointers,
                          std::initializer_list<int64_t> strides,
                          std::initializer_list<int64_t> extents) {
  if (in != DType::kBF16 && in != DType::kF16) return false;
  for (const void* p : pointers) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  for (int64_t s : strides) {
    if (s % 8 != 0) return false;
  }
  for (int64_t e : extents) {
    if (e <= 0 || e % 8 != 0 || e > std::numeric_limits<int32_t>::max()) return false;
  }
  return true;
}

// rhs[j] has one unit stride (its innermost dimension); the other is its leading dimension.
// The row count m bounds every group's M (row-grouped) or K (contraction) extent.
bool tensor_core_eligible(const RowGroupedGemm& g) {
  return g.m <= std::numeric_limits<int32_t>::max() &&
         tensor_core_eligible(g.in_type, {g.a, g.b, g.c},
                              {g.lda, g.b_batch, std::max(g.b_s0, g.b_s1), g.ldc}, {g.kc, g.n});
}

bool tensor_core_eligible(const ContractionGroupedGemm& g) {
  return g.m <= std::numeric_limits<int32_t>::max() &&
         tensor_core_eligible(g.in_type, {g.x, g.y, g.c}, {g.ldx, g.ldy, g.c_batch, g.ldc},
                              {g.p, g.q});
}

}  // namespace moekit::detail::cuda

int moekit::cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}
