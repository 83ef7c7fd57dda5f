// The portable CUDA grouped GEMM: any dtype (f32, bf16, f16), any alignment, any compute
// capability. A plain shared-memory tiled kernel with f32 accumulation (64x64 output tiles,
// 256 threads, 4x4 outputs each); the fallback for calls the tensor-core kernels do not take, and
// a second opinion on them in the tests.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/grouped_gemm_cuda.h"
#include "cuda/plan.cuh"

namespace moekit::detail::cuda {
namespace {

constexpr int kTileM = 64, kTileN = 64, kTileK = 16, kThreads = 256;
static_assert(kTileM * kTileN == kThreads * 16, "each thread owns a 4x4 block of the tile");

__device__ float to_float(float v) { return v; }
__device__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ float to_float(__half v) { return __half2float(v); }

template <class T>
__device__ T from_float(float v);
template <>
__device__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}

// acc[i][j] += sum over k in [k_begin, k_end) of A(ty*4 + i, k) * B(k, tx*4 + j), with
// load_a(i, k) and load_b(k, j) returning the tile's elements as f32 (0 outside the problem).
// kAAlongM: A's consecutive elements run along the tile's rows (else along k), which sets the
// order the threads load in so that a warp reads consecutive addresses.
template <bool kAAlongM, class LoadA, class LoadB>
__device__ void tile_product(float (&acc)[4][4], int64_t k_begin, int64_t k_end, LoadA load_a,
                             LoadB load_b) {
  __shared__ float a_tile[kTileK][kTileM + 4];  // [k, i]
  __shared__ float b_tile[kTileK][kTileN + 4];  // [k, j]
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kTileK) {
    for (int e = threadIdx.x; e < kTileM * kTileK; e += kThreads) {
      const int i = kAAlongM ? e % kTileM : e / kTileK;
      const int kk = kAAlongM ? e / kTileM : e % kTileK;
      a_tile[kk][i] = k0 + kk < k_end ? load_a(i, k0 + kk) : 0.0f;
    }
    for (int e = threadIdx.x; e < kTileK * kTileN; e += kThreads) {
      const int kk = e / kTileN, j = e % kTileN;
      b_tile[kk][j] = k0 + kk < k_end ? load_b(k0 + kk, j) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTileK; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = a_tile[kk][ty * 4 + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = b_tile[kk][tx * 4 + j];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
      }
    }
    __syncthreads();
  }
}

// Writes the thread's 4x4 block at tile rows [row_lo, row_hi) and columns < cols: c(i, j) gives
// the element's address.
template <class TOut, class Addr>
__device__ void store_tile(const float (&acc)[4][4], int row_lo, int row_hi, int cols,
                           bool accumulate, Addr c) {
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = ty * 4 + i;
    if (r < row_lo || r >= row_hi) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int col = tx * 4 + j;
      if (col >= cols) continue;
      TOut* p = c(r, col);
      *p = from_float<TOut>(accumulate ? to_float(*p) + acc[i][j] : acc[i][j]);
    }
  }
}

// Row-grouped: a block owns rows [m0, m0 + 64) x columns [n0, n0 + 64) of C and computes one
// pass per local group that meets its rows (usually one), masking the other rows.
template <class TIn, class TOut>
__global__ void __launch_bounds__(kThreads)
    row_grouped_kernel(RowGroupedGemm g, int64_t num_local, Plan plan) {
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kTileM;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kTileN;
  const auto* a = static_cast<const TIn*>(g.a);
  const auto* b = static_cast<const TIn*>(g.b);
  auto* c = static_cast<TOut*>(g.c);
  const int cols = static_cast<int>(g.n - n0 < kTileN ? g.n - n0 : kTileN);
  // The first local group that ends past m0 (group ends never decrease): a binary search.
  int64_t lo = 0, hi = num_local;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (plan.begin[mid] + plan.rows[mid] <= m0)
      lo = mid + 1;
    else
      hi = mid;
  }
  for (int64_t j = lo; j < num_local && plan.begin[j] < m0 + kTileM; ++j) {
    const int64_t begin = plan.begin[j], end = begin + plan.rows[j];
    if (end <= m0 || begin >= end) continue;
    const int row_lo = static_cast<int>(begin > m0 ? begin - m0 : 0);
    const int row_hi = static_cast<int>(end - m0 < kTileM ? end - m0 : kTileM);
    const TIn* bj = b + j * g.b_batch;
    float acc[4][4] = {};
    tile_product</*kAAlongM=*/false>(
        acc, 0, g.kc,
        [&](int i, int64_t k) {
          return i >= row_lo && i < row_hi ? to_float(a[(m0 + i) * g.lda + k]) : 0.0f;
        },
        [&](int64_t k, int jj) {
          return jj < cols ? to_float(bj[k * g.b_s0 + (n0 + jj) * g.b_s1]) : 0.0f;
        });
    store_tile<TOut>(acc, row_lo, row_hi, cols, g.accumulate,
                     [&](int i, int jj) { return c + (m0 + i) * g.ldc + n0 + jj; });
  }
}

// Contraction-grouped: a block owns rows [p0, p0 + 64) x columns [q0, q0 + 64) of C_j for the
// local groups j = blockIdx.z, blockIdx.z + gridDim.z, ...; it sums over the group's rows.
template <class TIn, class TOut>
__global__ void __launch_bounds__(kThreads)
    contraction_grouped_kernel(ContractionGroupedGemm g, int64_t num_local, Plan plan) {
  const int64_t p0 = static_cast<int64_t>(blockIdx.x) * kTileM;
  const int64_t q0 = static_cast<int64_t>(blockIdx.y) * kTileN;
  const auto* x = static_cast<const TIn*>(g.x);
  const auto* y = static_cast<const TIn*>(g.y);
  auto* c = static_cast<TOut*>(g.c);
  const int rows_here = static_cast<int>(g.p - p0 < kTileM ? g.p - p0 : kTileM);
  const int cols = static_cast<int>(g.q - q0 < kTileN ? g.q - q0 : kTileN);
  for (int64_t j = blockIdx.z; j < num_local; j += gridDim.z) {
    const int64_t begin = plan.begin[j], end = begin + plan.rows[j];
    if (begin >= end) continue;  // an empty group: zeroed by zero_uncovered (or untouched)
    float acc[4][4] = {};
    tile_product</*kAAlongM=*/true>(
        acc, begin, end,
        [&](int i, int64_t r) { return i < rows_here ? to_float(x[r * g.ldx + p0 + i]) : 0.0f; },
        [&](int64_t r, int jj) { return jj < cols ? to_float(y[r * g.ldy + q0 + jj]) : 0.0f; });
    store_tile<TOut>(acc, 0, rows_here, cols, g.accumulate,
                     [&](int i, int jj) { return c + j * g.c_batch + (p0 + i) * g.ldc + q0 + jj; });
  }
}

unsigned tiles(int64_t extent, int tile) {
  return static_cast<unsigned>((extent + tile - 1) / tile);
}

// Calls f with a value of the input type and one of the output type (null pointers: only their
// types matter); false for a pair the portable kernels do not have.
template <class F>
bool with_types(DType in, DType out, F f) {
  auto with_out = [&](auto in_v) {
    using TIn = decltype(in_v);
    if (out == DType::kF32) return f(TIn{}, float{}), true;
    if (out == in) return f(TIn{}, TIn{}), true;
    return false;
  };
  switch (in) {
    case DType::kF32:
      return with_out(float{});
    case DType::kBF16:
      return with_out(__nv_bfloat16{});
    case DType::kF16:
      return with_out(__half{});
    default:
      return false;
  }
}

constexpr const char* kOp = "ragged_dot (CUDA, portable)";

}  // namespace

size_t portable_workspace_size(int64_t num_local) { return plan_bytes(num_local); }

Status row_grouped_portable(const RowGroupedGemm& g) {
  const Groups& groups = g.groups;
  const Exec& exec = g.exec;
  MOEKIT_RETURN_IF_ERROR(check_workspace(kOp, exec, portable_workspace_size(groups.num_local)));
  MOEKIT_RETURN_IF_ERROR(plan_and_zero(kOp, g, groups, exec.workspace, EmitNothing{}, exec.stream));
  if (g.m == 0 || g.n == 0 || groups.num_local == 0) return {};
  const Plan plan = plan_in(exec.workspace, groups.num_local);
  const dim3 grid(tiles(g.m, kTileM), tiles(g.n, kTileN));
  const bool known = with_types(g.in_type, g.out_type, [&](auto in, auto out) {
    row_grouped_kernel<decltype(in), decltype(out)>
        <<<grid, kThreads, 0, exec.stream>>>(g, groups.num_local, plan);
  });
  if (!known) return Status::unimplemented(kOp, "no kernel for these dtypes");
  return launch_status(kOp, "the row-grouped kernel");
}

Status contraction_grouped_portable(const ContractionGroupedGemm& g) {
  const Groups& groups = g.groups;
  const Exec& exec = g.exec;
  MOEKIT_RETURN_IF_ERROR(check_workspace(kOp, exec, portable_workspace_size(groups.num_local)));
  MOEKIT_RETURN_IF_ERROR(plan_and_zero(kOp, g, groups, exec.workspace, EmitNothing{}, exec.stream));
  if (g.p == 0 || g.q == 0 || groups.num_local == 0) return {};
  const Plan plan = plan_in(exec.workspace, groups.num_local);
  const int64_t z = groups.num_local < 65535 ? groups.num_local : 65535;
  const dim3 grid(tiles(g.p, kTileM), tiles(g.q, kTileN), static_cast<unsigned>(z));
  const bool known = with_types(g.in_type, g.out_type, [&](auto in, auto out) {
    contraction_grouped_kernel<decltype(in), decltype(out)>
        <<<grid, kThreads, 0, exec.stream>>>(g, groups.num_local, plan);
  });
  if (!known) return Status::unimplemented(kOp, "no kernel for these dtypes");
  return launch_status(kOp, "the contraction-grouped kernel");
}

}  // namespace moekit::detail::cuda
