// The elementwise steps and memory moves of layer_ops.h on CUDA: f32 sums and roundings of rows
// (one thread per 8 elements where the rows are aligned for 16-byte words), and the runtime's
// asynchronous copies, fills and the stream wait.
#include <cuda_runtime.h>

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

}  // namespace

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
