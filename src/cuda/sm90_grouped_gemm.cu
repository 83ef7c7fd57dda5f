// The sm90 entry points of grouped_gemm_cuda.h. The kernels are instantiated per input dtype in
// sm90_grouped_gemm_bf16.cu and sm90_grouped_gemm_f16.cu. Configured with
// MOEKIT_CUDA_SM90_CANDIDATES=ON, the build also holds two bf16 tuning candidates
// (sm90_grouped_gemm_bf16_<config>.cu), which the environment variable MOEKIT_CUDA_SM90_KERNEL
// picks so that one build can time each (scripts/device-check); neither has been shown to be
// faster, so they are left out by default.
#include <algorithm>
#include <cstdlib>
#include <string>

#include "cuda/sm90_grouped_gemm.cuh"

namespace moekit::detail::cuda {

namespace tc {
MOEKIT_TC_EXTERN(sm90::Kernel, cutlass::bfloat16_t)
MOEKIT_TC_EXTERN(sm90::Kernel, cutlass::half_t)
#if MOEKIT_CUDA_SM90_CANDIDATES
MOEKIT_TC_EXTERN(sm90::KernelCoop256, cutlass::bfloat16_t)
MOEKIT_TC_EXTERN(sm90::KernelPingpong, cutlass::bfloat16_t)
#endif
}  // namespace tc

namespace {

using BF16 = cutlass::bfloat16_t;

#if MOEKIT_CUDA_SM90_CANDIDATES
// Which family runs bf16 calls: MOEKIT_CUDA_SM90_KERNEL, read once. Unset: cooperative. f16
// calls always run cooperative.
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

// Runs a bf16 call on the candidate MOEKIT_CUDA_SM90_KERNEL names into *status and says true;
// false where the default kernel runs it.
template <class Problem, class Run256, class RunPingpong>
bool run_candidate(const Problem& g, Status* status, Run256 run256, RunPingpong run_pingpong) {
  if (g.in_type != DType::kBF16) return false;
  Sm90Family family;
  *status = bf16_family(&family);
  if (!status->ok()) return true;
  if (family == Sm90Family::kCooperative256) *status = run256();
  if (family == Sm90Family::kPingpong) *status = run_pingpong();
  return family != Sm90Family::kCooperative;
}
#endif

}  // namespace

size_t sm90_workspace_size(int64_t num_local, const DeviceInfo& info) {
  size_t bytes = tc::workspace_size_any<sm90::Kernel>(num_local, info);
#if MOEKIT_CUDA_SM90_CANDIDATES
  bytes = std::max({bytes, tc::workspace_size<sm90::KernelCoop256, BF16>(num_local, info),
                    tc::workspace_size<sm90::KernelPingpong, BF16>(num_local, info)});
#endif
  return bytes;
}

Status row_grouped_sm90(const RowGroupedGemm& g) {
  DeviceInfo info;
  MOEKIT_RETURN_IF_ERROR(device_info(&info));
#if MOEKIT_CUDA_SM90_CANDIDATES
  Status status;
  if (run_candidate(
          g, &status,
          [&] { return tc::row_grouped<sm90::KernelCoop256, BF16>(g, g.groups, g.exec, info); },
          [&] { return tc::row_grouped<sm90::KernelPingpong, BF16>(g, g.groups, g.exec, info); })) {
    return status;
  }
#endif
  return tc::row_grouped_any<sm90::Kernel>(g, g.groups, g.exec, info);
}

Status contraction_grouped_sm90(const ContractionGroupedGemm& g) {
  DeviceInfo info;
  MOEKIT_RETURN_IF_ERROR(device_info(&info));
#if MOEKIT_CUDA_SM90_CANDIDATES
  Status status;
  if (run_candidate(
          g, &status,
          [&] {
            return tc::contraction_grouped<sm90::KernelCoop256, BF16>(g, g.groups, g.exec, info);
          },
          [&] {
            return tc::contraction_grouped<sm90::KernelPingpong, BF16>(g, g.groups, g.exec, info);
          })) {
    return status;
  }
#endif
  return tc::contraction_grouped_any<sm90::Kernel>(g, g.groups, g.exec, info);
}

}  // namespace moekit::detail::cuda
