// Public CUDA ragged_dot entry points: check on the host what the host knows (shapes, dtypes,
// strides, G >= E_loc, a host group_offset), then hand the problem and the device groups to the
// first implementation that the device, the call and `impl` allow. Built without CUDA, each entry
// point still checks its arguments and then says it is not available.
#include "moekit/ragged_dot_cuda.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>

#include "check.h"
#include "ragged_dot_problem.h"
#if MOEKIT_HAS_CUDA
#include "cuda/grouped_gemm_cuda.h"
#endif

namespace moekit {
namespace {

Status check_device_groups(const char* op, const CudaGroups& groups, int64_t num_local,
                           const RaggedDotOptions& options) {
  MOEKIT_RETURN_IF_ERROR(detail::check_group_count(op, "groups.count", groups.count, num_local));
  if (groups.count > 0 && groups.sizes == nullptr) {
    return Status::invalid_argument(op, "groups.sizes", "null",
                                    fmt::format("{} groups need a size array", groups.count));
  }
  if (groups.offset != nullptr) return {};  // on the device: clamped there
  return detail::check_group_offset(op, options.group_offset, groups.count, num_local);
}

// The output apart from the inputs, the groups and the workspace (which the call also writes).
Status check_device_disjoint(const char* op, const detail::Region& out, const detail::Region& a,
                             const detail::Region& b, const CudaGroups& groups,
                             const CudaExec& exec) {
  const size_t count = groups.count > 0 ? static_cast<size_t>(groups.count) : 0;
  return detail::check_disjoint(
      op, {out, {"exec.workspace", exec.workspace, exec.workspace_bytes}},
      {a,
       b,
       {"groups.sizes", groups.sizes, count * sizeof(int32_t)},
       {"groups.offset", groups.offset, groups.offset ? sizeof(int32_t) : 0}});
}

#if MOEKIT_HAS_CUDA
using detail::cuda::DeviceGroups;
using detail::cuda::DeviceInfo;

DeviceGroups device_groups(const CudaGroups& groups, int64_t num_local,
                           const RaggedDotOptions& options) {
  return DeviceGroups{groups.sizes, groups.count, groups.offset, options.group_offset, num_local};
}

// The implementations in order of preference, with what each needs.
template <class Problem, class Run90, class Run80, class RunPortable>
Status run_implementation(const char* op, const Problem& g, RaggedDotCudaImpl impl, Run90 run90,
                          Run80 run80, RunPortable run_portable) {
  DeviceInfo info;
  MOEKIT_RETURN_IF_ERROR(detail::cuda::device_info(&info));
  const bool tc = detail::cuda::tensor_core_eligible(g);
  const bool sm90 = tc && info.arch == 90 && MOEKIT_CUDA_SM90;
  const bool sm80 = tc && info.arch >= 80 && MOEKIT_CUDA_SM80;
  auto refuse = [&](const char* name, const char* needs) {
    return Status::unimplemented(
        op, fmt::format("impl {} needs {}; this call: {} inputs on a device of compute "
                        "capability {}.{}{}",
                        name, needs, dtype_name(g.in_type), info.arch / 10, info.arch % 10,
                        tc ? "" : ", not aligned for tensor cores"));
  };
  switch (impl) {
    case RaggedDotCudaImpl::kAuto:
      if (sm90) return run90(info);
      if (sm80) return run80(info);
      return run_portable();
    case RaggedDotCudaImpl::kSm90:
      return sm90 ? run90(info)
                  : refuse("kSm90",
                           "bf16/f16 aligned inputs, compute capability 9.0, a build "
                           "with sm_90a");
    case RaggedDotCudaImpl::kSm80:
      return sm80 ? run80(info)
                  : refuse("kSm80",
                           "bf16/f16 aligned inputs, compute capability >= 8.0, a "
                           "build with sm_80");
    case RaggedDotCudaImpl::kPortable:
      return run_portable();
  }
  return Status::invalid_argument(op, "impl", std::to_string(static_cast<int>(impl)),
                                  "not a RaggedDotCudaImpl");
}
#endif

Status row_grouped_cuda(const char* op, const char* a_name, ConstTensorView a, ConstTensorView rhs,
                        const CudaGroups& groups, const char* c_name, TensorView c,
                        const RaggedDotOptions& options, const CudaExec& exec,
                        RaggedDotCudaImpl impl, bool contract_over_rhs_n) {
  detail::RowGroupedGemm g;
  MOEKIT_RETURN_IF_ERROR(detail::row_problem(op, a_name, a, rhs, c_name, c, options,
                                             contract_over_rhs_n, /*allow_f16=*/true, &g));
  MOEKIT_RETURN_IF_ERROR(check_device_groups(op, groups, rhs.shape[0], options));
  MOEKIT_RETURN_IF_ERROR(
      check_device_disjoint(op, {c_name, c}, {a_name, a}, {"rhs", rhs}, groups, exec));
#if MOEKIT_HAS_CUDA
  const DeviceGroups dg = device_groups(groups, rhs.shape[0], options);
  namespace cu = detail::cuda;
  return run_implementation(
      op, g, impl, [&](const DeviceInfo& info) { return cu::row_grouped_sm90(g, dg, exec, info); },
      [&](const DeviceInfo& info) { return cu::row_grouped_sm80(g, dg, exec, info); },
      [&] { return cu::row_grouped_portable(g, dg, exec); });
#else
  (void)exec, (void)impl;
  return Status::unimplemented(op, "moekit was built without its CUDA backend");
#endif
}

}  // namespace

bool cuda_built() { return MOEKIT_HAS_CUDA != 0; }

#if !MOEKIT_HAS_CUDA
int cuda_device_count() { return 0; }
#endif  // else in cuda/common.cu

size_t ragged_dot_cuda_workspace_size(int64_t num_local_groups) {
#if MOEKIT_HAS_CUDA
  namespace cu = detail::cuda;
  size_t bytes = cu::portable_workspace_size(num_local_groups);
  DeviceInfo info;
  if (!cu::device_info(&info).ok()) return bytes;
  if (MOEKIT_CUDA_SM80 && info.arch >= 80) {
    bytes = std::max(bytes, cu::sm80_workspace_size(num_local_groups, info));
  }
  if (MOEKIT_CUDA_SM90 && info.arch == 90) {
    bytes = std::max(bytes, cu::sm90_workspace_size(num_local_groups, info));
  }
  return bytes;
#else
  (void)num_local_groups;
  return 0;
#endif
}

Status ragged_dot_cuda(ConstTensorView lhs, ConstTensorView rhs, const CudaGroups& groups,
                       TensorView out, const RaggedDotOptions& options, const CudaExec& exec,
                       RaggedDotCudaImpl impl) {
  return row_grouped_cuda("ragged_dot", "lhs", lhs, rhs, groups, "out", out, options, exec, impl,
                          /*contract_over_rhs_n=*/false);
}

Status ragged_dot_dlhs_cuda(ConstTensorView d_out, ConstTensorView rhs, const CudaGroups& groups,
                            TensorView d_lhs, const RaggedDotOptions& options, const CudaExec& exec,
                            RaggedDotCudaImpl impl) {
  return row_grouped_cuda("ragged_dot_dlhs", "d_out", d_out, rhs, groups, "d_lhs", d_lhs, options,
                          exec, impl, /*contract_over_rhs_n=*/true);
}

Status ragged_dot_drhs_cuda(ConstTensorView lhs, ConstTensorView d_out, const CudaGroups& groups,
                            TensorView d_rhs, const RaggedDotOptions& options, const CudaExec& exec,
                            RaggedDotCudaImpl impl) {
  const char* op = "ragged_dot_drhs";
  detail::ContractionGroupedGemm g;
  MOEKIT_RETURN_IF_ERROR(
      detail::contraction_problem(op, lhs, d_out, d_rhs, options, /*allow_f16=*/true, &g));
  MOEKIT_RETURN_IF_ERROR(check_device_groups(op, groups, d_rhs.shape[0], options));
  MOEKIT_RETURN_IF_ERROR(
      check_device_disjoint(op, {"d_rhs", d_rhs}, {"lhs", lhs}, {"d_out", d_out}, groups, exec));
#if MOEKIT_HAS_CUDA
  const DeviceGroups dg = device_groups(groups, d_rhs.shape[0], options);
  namespace cu = detail::cuda;
  return run_implementation(
      op, g, impl,
      [&](const DeviceInfo& info) { return cu::contraction_grouped_sm90(g, dg, exec, info); },
      [&](const DeviceInfo& info) { return cu::contraction_grouped_sm80(g, dg, exec, info); },
      [&] { return cu::contraction_grouped_portable(g, dg, exec); });
#else
  (void)exec, (void)impl;
  return Status::unimplemented(op, "moekit was built without its CUDA backend");
#endif
}

}  // namespace moekit
