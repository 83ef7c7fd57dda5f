// The elementwise steps and memory moves of layer_ops.h on CUDA: f32 sums and roundings of rows
// (one thread per 8 elements where the rows are aligned for 16-byte words), the expert biases
// (a group's bias row added to its rows, and each group's row sum), and the runtime's
// asynchronous copies, fills and the stream wait.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/launch.cuh"
#include "cuda/layer_ops_cuda.h"
#include "cuda/rows.cuh"

namespace moekit::detail::cuda {
namespace {

struct RowsArgs {
  Mat a, b;  // add: a += b; convert: b = a
  int64_t rows, cols;
};

template <int V>
__global__ void __launch_bounds__(kElementwiseThreads) add_kernel(RowsArgs a) {
  MOEKIT_FOR_EACH_ELEMENTS(r, j, a.rows, a.cols, V) {
    float x[V], y[V];
    load_elems(a.a.row(r), a.a.t, j, x);
    load_elems(a.b.row(r), a.b.t, j, y);
#pragma unroll
    for (int i = 0; i < V; ++i) x[i] += y[i];
    store_elems(a.a.row(r), a.a.t, j, x);
  }
}

template <int V>
__global__ void __launch_bounds__(kElementwiseThreads) convert_kernel(RowsArgs a) {
  MOEKIT_FOR_EACH_ELEMENTS(r, j, a.rows, a.cols, V) {
    float x[V];
    load_elems(a.a.row(r), a.a.t, j, x);
    store_elems(a.b.row(r), a.b.t, j, x);
  }
}

template <class K8, class K1>
Status launch_rows(const char* what, const RowsArgs& a, cudaStream_t stream, K8 k8, K1 k1) {
  if (a.rows == 0 || a.cols == 0) return {};
  launch_elementwise(rows_aligned({a.a, a.b}, a.cols), a.rows, a.cols, stream, k8, k1, a);
  return launch_status("moe_layer", what);
}

// The expert biases. The group sizes live on the device (up to kMaxGroups of them): each block
// reads them into shared memory and takes their prefix sums itself, a negative size counting
// as 0 and the groups cut at the rows there are.
constexpr int kMaxGroups = 1024;
constexpr int kBiasThreads = 256;

struct GroupArgs {
  Mat rows, bias;  // add: rows [R, W] += bias [G, W] by group; sums: bias [G, W] = the sums
  const int32_t* sizes;
  int G;
  int64_t R, W;
};

// ends[g]: the end row of group g (shared memory, G entries), every thread of the block.
__device__ void group_ends(const GroupArgs& a, int64_t* ends) {
  for (int g = threadIdx.x; g < a.G; g += blockDim.x) ends[g] = max(a.sizes[g], 0);
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t end = 0;
    for (int g = 0; g < a.G; ++g) {
      end += ends[g];
      ends[g] = min(end, a.R);
    }
  }
  __syncthreads();
}

// Grid-stride over the rows of the groups; a row's group by binary search of the ends.
__global__ void __launch_bounds__(kBiasThreads) add_group_bias_kernel(GroupArgs a) {
  __shared__ int64_t ends[kMaxGroups];
  group_ends(a, ends);
  const int64_t used = ends[a.G - 1];
  for (int64_t r = blockIdx.x; r < used; r += gridDim.x) {
    int lo = 0, hi = a.G - 1;  // the first group whose end is past r
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (ends[mid] > r) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    for (int64_t j = threadIdx.x; j < a.W; j += blockDim.x) {
      store_float(a.rows, r, j, load_float(a.rows, r, j) + load_float(a.bias, lo, j));
    }
  }
}

// Block (g, column tile): each thread sums one column of group g's rows, in row order.
__global__ void __launch_bounds__(kBiasThreads) group_sums_kernel(GroupArgs a) {
  __shared__ int64_t ends[kMaxGroups];
  group_ends(a, ends);
  const int g = blockIdx.x;
  const int64_t j = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (j >= a.W) return;
  float sum = 0.0f;
  for (int64_t r = g == 0 ? 0 : ends[g - 1]; r < ends[g]; ++r) sum += load_float(a.rows, r, j);
  store_float(a.bias, g, j, sum);
}

// The layer refuses more experts on CUDA before it gets here (layer.h).
Status check_groups(size_t G) {
  if (G <= static_cast<size_t>(kMaxGroups)) return {};
  return Status::unimplemented("moe_layer", "the expert biases of more than 1024 experts on CUDA");
}

}  // namespace

Status add_group_bias_cuda(const TensorView& rows, std::span<const int32_t> sizes,
                           const ConstTensorView& bias, const Exec& exec) {
  MOEKIT_RETURN_IF_ERROR(check_groups(sizes.size()));
  if (sizes.empty() || rows.shape[0] == 0 || rows.shape[1] == 0) return {};
  const GroupArgs a{Mat(rows),     Mat(bias),    sizes.data(), static_cast<int>(sizes.size()),
                    rows.shape[0], rows.shape[1]};
  const int64_t blocks = std::min<int64_t>(rows.shape[0], 4096);
  add_group_bias_kernel<<<static_cast<unsigned>(blocks), kBiasThreads, 0, exec.stream>>>(a);
  return launch_status("moe_layer", "the expert bias");
}

Status group_sums_cuda(const ConstTensorView& rows, std::span<const int32_t> sizes,
                       const TensorView& out, const Exec& exec) {
  MOEKIT_RETURN_IF_ERROR(check_groups(sizes.size()));
  if (sizes.empty() || out.shape[1] == 0) return {};
  const GroupArgs a{Mat(rows),     Mat(out),    sizes.data(), static_cast<int>(sizes.size()),
                    rows.shape[0], out.shape[1]};
  const dim3 grid(static_cast<unsigned>(sizes.size()),
                  static_cast<unsigned>((out.shape[1] + kBiasThreads - 1) / kBiasThreads));
  group_sums_kernel<<<grid, kBiasThreads, 0, exec.stream>>>(a);
  return launch_status("moe_layer", "the expert bias gradient");
}

Status add_rows_cuda(const TensorView& acc, const ConstTensorView& v, const Exec& exec) {
  return launch_rows("the f32 row sum", {Mat(acc), Mat(v), acc.shape[0], acc.shape[1]}, exec.stream,
                     add_kernel<8>, add_kernel<1>);
}

Status convert_rows_cuda(const ConstTensorView& in, const TensorView& out, const Exec& exec) {
  return launch_rows("the rounding of f32 rows", {Mat(in), Mat(out), in.shape[0], in.shape[1]},
                     exec.stream, convert_kernel<8>, convert_kernel<1>);
}

Status copy_2d_cuda(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                    size_t row_bytes, size_t rows, const Exec& exec) {
  if (rows == 0 || row_bytes == 0) return {};
  return cuda_status("moe_layer", "cudaMemcpy2DAsync",
                     cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows,
                                       cudaMemcpyDefault, exec.stream));
}

Status zero_bytes_cuda(void* dst, size_t bytes, const Exec& exec) {
  if (bytes == 0) return {};
  return cuda_status("moe_layer", "cudaMemsetAsync", cudaMemsetAsync(dst, 0, bytes, exec.stream));
}

Status synchronize_cuda(const Exec& exec) {
  return cuda_status("moe_layer", "cudaStreamSynchronize", cudaStreamSynchronize(exec.stream));
}

}  // namespace moekit::detail::cuda
