// layer_ops.h: each step on the CPU here, or handed to its CUDA implementation.
#include "layer_ops.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "check.h"
#include "cpu/convert.h"
#if MOEKIT_HAS_CUDA
#include "cuda/layer_ops_cuda.h"
#endif

namespace moekit::detail {
namespace {

#if MOEKIT_HAS_CUDA
bool on_gpu(const Exec& exec) { return exec.device == Device::kCuda; }
#endif

// A [rows, cols] matrix as the one group [1, rows, cols] that ragged_dot multiplies by.
template <class View>
View as_group(View g) {
  g.rank = 3;
  g.shape = {1, g.shape[0], g.shape[1], 0};
  g.stride = {g.shape[1] * g.stride[0], g.stride[0], g.stride[1], 0};
  return g;
}

#if MOEKIT_HAS_CUDA
Status refuse_invariant(const char* op, const RaggedDotOptions& o) {
  if (!o.batch_invariant) return {};
  return Status::unimplemented(op, "the batch-invariant mode runs on the CPU only");
}
#endif

}  // namespace

Status dense_dot(ConstTensorView a, ConstTensorView b, TensorView c,
                 const RaggedDotOptions& options, const Exec& exec) {
#if MOEKIT_HAS_CUDA
  if (on_gpu(exec)) {
    MOEKIT_RETURN_IF_ERROR(refuse_invariant("dense_dot", options));
    return cuda::cublas_matmul("dense_dot", a, false, b, false, c, options.accumulate, exec);
  }
#endif
  const int32_t rows[1] = {static_cast<int32_t>(a.shape[0])};
  return ragged_dot(a, as_group(b), rows, c, options, exec);
}

Status dense_dot_dlhs(ConstTensorView d_c, ConstTensorView b, TensorView d_a,
                      const RaggedDotOptions& options, const Exec& exec) {
#if MOEKIT_HAS_CUDA
  if (on_gpu(exec)) {
    MOEKIT_RETURN_IF_ERROR(refuse_invariant("dense_dot_dlhs", options));
    return cuda::cublas_matmul("dense_dot_dlhs", d_c, false, b, true, d_a, options.accumulate,
                               exec);
  }
#endif
  const int32_t rows[1] = {static_cast<int32_t>(d_c.shape[0])};
  return ragged_dot_dlhs(d_c, as_group(b), rows, d_a, options, exec);
}

Status dense_dot_drhs(ConstTensorView a, ConstTensorView d_c, TensorView d_b,
                      const RaggedDotOptions& options, const Exec& exec) {
#if MOEKIT_HAS_CUDA
  if (on_gpu(exec)) {
    MOEKIT_RETURN_IF_ERROR(refuse_invariant("dense_dot_drhs", options));
    return cuda::cublas_matmul("dense_dot_drhs", a, true, d_c, false, d_b, options.accumulate,
                               exec);
  }
#endif
  const int32_t rows[1] = {static_cast<int32_t>(a.shape[0])};
  return ragged_dot_drhs(a, d_c, rows, as_group(d_b), options, exec);
}

size_t dense_dot_workspace_size(Device device) {
#if MOEKIT_HAS_CUDA
  if (device == Device::kCuda) return cuda::cublas_workspace_bytes();
#endif
  (void)device;
  return 0;
}

Status add_rows(const TensorView& acc, const ConstTensorView& v,
                [[maybe_unused]] const Exec& exec) {
#if MOEKIT_HAS_CUDA
  if (on_gpu(exec)) return cuda::add_rows_cuda(acc, v, exec);
#endif
  const int64_t rows = acc.shape[0], cols = acc.shape[1];
#pragma omp parallel for schedule(static) if (rows * cols >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    auto* a = reinterpret_cast<float*>(row_ptr(acc, r));
    const auto* b = reinterpret_cast<const float*>(row_ptr(v, r));
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) a[j] += b[j];
  }
  return {};
}

Status convert_rows(const ConstTensorView& in, const TensorView& out,
                    [[maybe_unused]] const Exec& exec) {
#if MOEKIT_HAS_CUDA
  if (on_gpu(exec)) return cuda::convert_rows_cuda(in, out, exec);
#endif
  const int64_t rows = in.shape[0], cols = in.shape[1];
#pragma omp parallel for schedule(static) if (rows * cols >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    store_row_from_float(reinterpret_cast<const float*>(row_ptr(in, r)), cols, row_ptr(out, r),
                         out.dtype);
  }
  return {};
}

namespace {

// The end row of each group (an inclusive prefix sum of sizes), capped at `rows`.
std::vector<int64_t> group_ends(std::span<const int32_t> sizes, int64_t rows) {
  std::vector<int64_t> ends(sizes.size());
  int64_t end = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    end += sizes[g];
    ends[g] = std::min(end, rows);
  }
  return ends;
}

}  // namespace

Status add_group_bias(const TensorView& rows, std::span<const int32_t> sizes,
                      const ConstTensorView& bias, [[maybe_unused]] const Exec& exec) {
#if MOEKIT_HAS_CUDA
  if (on_gpu(exec)) return cuda::add_group_bias_cuda(rows, sizes, bias, exec);
#endif
  const std::vector<int64_t> ends = group_ends(sizes, rows.shape[0]);
  const int64_t used = ends.empty() ? 0 : ends.back(), W = rows.shape[1];
#pragma omp parallel if (used * W >= (1 << 16))
  {
    std::vector<float> row(static_cast<size_t>(W)), b(static_cast<size_t>(W));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < used; ++r) {
      const auto g = std::upper_bound(ends.begin(), ends.end(), r) - ends.begin();
      load_row_as_float(row_ptr(rows, r), rows.dtype, W, row.data());
      load_row_as_float(row_ptr(bias, g), bias.dtype, W, b.data());
#pragma omp simd
      for (int64_t j = 0; j < W; ++j) row[j] += b[j];
      store_row_from_float(row.data(), W, row_ptr(rows, r), rows.dtype);
    }
  }
  return {};
}

Status group_sums(const ConstTensorView& rows, std::span<const int32_t> sizes,
                  const TensorView& out, [[maybe_unused]] const Exec& exec) {
#if MOEKIT_HAS_CUDA
  if (on_gpu(exec)) return cuda::group_sums_cuda(rows, sizes, out, exec);
#endif
  const std::vector<int64_t> ends = group_ends(sizes, rows.shape[0]);
  const int64_t G = out.shape[0], W = out.shape[1];
  // One group a task: its rows summed in order (the same bits on any number of threads).
#pragma omp parallel if (rows.shape[0] * W >= (1 << 16))
  {
    std::vector<float> sum(static_cast<size_t>(W)), row(static_cast<size_t>(W));
#pragma omp for schedule(dynamic)
    for (int64_t g = 0; g < G; ++g) {
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t r = g == 0 ? 0 : ends[g - 1]; r < ends[g]; ++r) {
        load_row_as_float(row_ptr(rows, r), rows.dtype, W, row.data());
#pragma omp simd
        for (int64_t j = 0; j < W; ++j) sum[j] += row[j];
      }
      store_row_from_float(sum.data(), W, row_ptr(out, g), out.dtype);
    }
  }
  return {};
}

Status copy_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
               size_t rows, [[maybe_unused]] const Exec& exec) {
#if MOEKIT_HAS_CUDA
  if (on_gpu(exec))
    return cuda::copy_2d_cuda(dst, dst_pitch, src, src_pitch, row_bytes, rows, exec);
#endif
  for (size_t r = 0; r < rows; ++r) {
    std::memcpy(static_cast<char*>(dst) + r * dst_pitch,
                static_cast<const char*>(src) + r * src_pitch, row_bytes);
  }
  return {};
}

Status zero_bytes(void* dst, size_t bytes, [[maybe_unused]] const Exec& exec) {
#if MOEKIT_HAS_CUDA
  if (on_gpu(exec)) return cuda::zero_bytes_cuda(dst, bytes, exec);
#endif
  if (bytes > 0) std::memset(dst, 0, bytes);
  return {};
}

Status synchronize([[maybe_unused]] const Exec& exec) {
#if MOEKIT_HAS_CUDA
  if (on_gpu(exec)) return cuda::synchronize_cuda(exec);
#endif
  return {};
}

}  // namespace moekit::detail
