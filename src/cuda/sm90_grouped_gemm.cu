// The sm90 entry points of grouped_gemm_cuda.h. The kernels are instantiated per input dtype in
// sm90_grouped_gemm_bf16.cu and sm90_grouped_gemm_f16.cu, and the bf16 tuning candidates in
// sm90_grouped_gemm_bf16_<config>.cu.
#include <cstdlib>
#include <string>

#include "cuda/sm90_grouped_gemm.cuh"

namespace moekit::detail::cuda {

namespace tc {
MOEKIT_TC_EXTERN(sm90::Kernel, cutlass::bfloat16_t)
MOEKIT_TC_EXTERN(sm90::Kernel, cutlass::half_t)
MOEKIT_TC_EXTERN(sm90::KernelCoop256, cutlass::bfloat16_t)
MOEKIT_TC_EXTERN(sm90::KernelPingpong, cutlass::bfloat16_t)
}  // namespace tc

namespace {

using BF16 = cutlass::bfloat16_t;

// Which family runs bf16 calls: the environment variable MOEKIT_CUDA_SM90_KERNEL, read once, so
// that one build can time each candidate (scripts/device-check). Unset: cooperative. f16 calls
// always run cooperative.
enum class Sm90Family { kCooperative, kCooperative256, kPingpong };

struct Choice {
  Status status;
  Sm90Family family;
};

Choice parse_choice(const char* env) {
  const std::string s = env ? env : "";
  if (s.empty() || s == "cooperative") return {{}, Sm90Family::kCooperative};
  if (s == "cooperative-256x128-2x1") return {{}, Sm90Family::kCooperative256};
  if (s == "pingpong") return {{}, Sm90Family::kPingpong};
  return {Status::invalid_argument("ragged_dot (CUDA, sm90)", "MOEKIT_CUDA_SM90_KERNEL", s,
                                   "expected cooperative, cooperative-256x128-2x1 or pingpong"),
          Sm90Family::kCooperative};
}

Status bf16_family(Sm90Family* out) {
  static const Choice choice = parse_choice(std::getenv("MOEKIT_CUDA_SM90_KERNEL"));
  *out = choice.family;
  return choice.status;
}

}  // namespace

size_t sm90_workspace_size(int64_t num_local, const DeviceInfo& info) {
  return std::max({tc::workspace_size_any<sm90::Kernel>(num_local, info),
                   tc::workspace_size<sm90::KernelCoop256, BF16>(num_local, info),
                   tc::workspace_size<sm90::KernelPingpong, BF16>(num_local, info)});
}

Status row_grouped_sm90(const RowGroupedGemm& g, const DeviceGroups& groups, const CudaExec& exec,
                        const DeviceInfo& info) {
  if (g.in_type == DType::kBF16) {
    Sm90Family family;
    MOEKIT_RETURN_IF_ERROR(bf16_family(&family));
    if (family == Sm90Family::kCooperative256) {
      return tc::row_grouped<sm90::KernelCoop256, BF16>(g, groups, exec, info);
    }
    if (family == Sm90Family::kPingpong) {
      return tc::row_grouped<sm90::KernelPingpong, BF16>(g, groups, exec, info);
    }
  }
  return tc::row_grouped_any<sm90::Kernel>(g, groups, exec, info);
}

Status contraction_grouped_sm90(const ContractionGroupedGemm& g, const DeviceGroups& groups,
                                const CudaExec& exec, const DeviceInfo& info) {
  if (g.in_type == DType::kBF16) {
    Sm90Family family;
    MOEKIT_RETURN_IF_ERROR(bf16_family(&family));
    if (family == Sm90Family::kCooperative256) {
      return tc::contraction_grouped<sm90::KernelCoop256, BF16>(g, groups, exec, info);
    }
    if (family == Sm90Family::kPingpong) {
      return tc::contraction_grouped<sm90::KernelPingpong, BF16>(g, groups, exec, info);
    }
  }
  return tc::contraction_grouped_any<sm90::Kernel>(g, groups, exec, info);
}

}  // namespace moekit::detail::cuda
