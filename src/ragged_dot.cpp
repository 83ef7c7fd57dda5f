// The ragged_dot entry points, for every backend: validate what the host can see (nothing is
// written before this is done), reduce the call to one of the two grouped-GEMM problems of
// ragged_dot_problem.h, and run the first implementation of its table that takes it. The CUDA
// implementations are in the tables where moekit is built with CUDA.
#include "moekit/ragged_dot.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>

#include "check.h"
#include "cpu/grouped_gemm.h"
#include "impl_table.h"
#include "ragged_dot_problem.h"
#if MOEKIT_HAS_CUDA
#include "cuda/grouped_gemm_cuda.h"
#endif

namespace moekit {
namespace {

using detail::ContractionGroupedGemm;
using detail::Implementation;
using detail::kCpuNeeds;
using detail::kCudaNeeds;
using detail::on_cpu;
using detail::on_cuda;
using detail::RowGroupedGemm;

#if MOEKIT_HAS_CUDA
namespace cu = detail::cuda;

int cuda_arch() {
  cu::DeviceInfo info;
  return cu::device_info(&info).ok() ? info.arch : 0;
}

template <class Problem>
bool on_sm90(const Problem& g) {
  return MOEKIT_CUDA_SM90 && on_cuda(g) && cu::tensor_core_eligible(g) && cuda_arch() == 90;
}

template <class Problem>
bool on_sm80(const Problem& g) {
  return MOEKIT_CUDA_SM80 && on_cuda(g) && cu::tensor_core_eligible(g) && cuda_arch() >= 80;
}

constexpr const char* kSm90Needs =
    "CUDA buffers, bf16/f16 inputs aligned for tensor cores, a device of compute capability 9.0 "
    "and a build with sm_90a";

// The pingpong (128x128 and 64x256) and cooperative 256x128 schedules are built for bf16 only.
template <class Problem>
bool on_sm90_bf16(const Problem& g) {
  return g.in_type == DType::kBF16 && on_sm90(g);
}
constexpr const char* kSm90Bf16Needs =
    "CUDA buffers, bf16 inputs aligned for tensor cores, a device of compute capability 9.0 and a "
    "build with sm_90a";

// Which sm90 schedule kAuto runs bf16 calls on, by shape and card: the weight gradient by
// cu::sm90_contraction_on_pingpong (cooperative 256x128 but for few groups of few rows on an
// H200), the forward and input gradient by cu::sm90_row_schedule. f16 calls run kCudaSm90.
bool card_is_bandwidth_rich() {
  cu::DeviceInfo info;
  return cu::device_info(&info).ok() && cu::sm90_bandwidth_rich(info);
}
bool sm90_contraction_picks_cooperative256(const ContractionGroupedGemm& g) {
  return !cu::sm90_contraction_on_pingpong(g.m, g.groups.count, card_is_bandwidth_rich());
}
RaggedDotImpl sm90_row_schedule(const RowGroupedGemm& g) {
  return cu::sm90_row_schedule({g.m, g.groups.count, g.groups.num_local, g.kc, g.n, g.b_s1 == 1},
                               card_is_bandwidth_rich());
}
bool sm90_rows_pick_cooperative256(const RowGroupedGemm& g) {
  return sm90_row_schedule(g) == RaggedDotImpl::kCudaSm90Cooperative256;
}
bool sm90_rows_pick_pingpong64(const RowGroupedGemm& g) {
  return sm90_row_schedule(g) == RaggedDotImpl::kCudaSm90Pingpong64x256;
}
// The run-order candidates run by name only.
bool by_name_only(const RowGroupedGemm&) { return false; }
bool by_name_only(const ContractionGroupedGemm&) { return false; }
constexpr const char* kSm80Needs =
    "CUDA buffers, bf16/f16 inputs aligned for tensor cores, a device of compute capability "
    ">= 8.0 and a build with sm_80";
#endif

// The streaming kernel's calls: on the CPU, outside the batch-invariant mode (where kAuto keeps
// oneDNN's invariant schedule; asked for by name it would be invariant too, but not the same
// bits). kAuto picks it where its groups are small enough (detail::stream_picks).
// On packed weights it takes every call (its kernel there is batch-invariant as it is), and is
// the one kAuto picks: oneDNN does not read that layout.
bool stream_takes(const RowGroupedGemm& g) {
  return on_cpu(g) && (!g.batch_invariant || g.b_packed);
}
bool stream_picks(const RowGroupedGemm& g) { return g.b_packed || detail::stream_picks(g); }
constexpr const char* kStreamNeeds =
    "host buffers and the default mode (not batch_invariant) unless the weights are packed";
// The weight gradient's sums of outer products: on the CPU, outside the batch-invariant mode.
bool outer_takes(const ContractionGroupedGemm& g) { return on_cpu(g) && !g.batch_invariant; }
constexpr const char* kOuterNeeds = "host buffers and the default mode (not batch_invariant)";
bool onednn_takes(const RowGroupedGemm& g) { return on_cpu(g) && !g.b_packed; }
constexpr const char* kOneDnnNeeds = "host buffers (Exec::device = kCpu) and weights not packed";

// In order of preference; the CPU's reference last.
constexpr Implementation<RaggedDotImpl, RowGroupedGemm> kRowImpls[] = {
#if MOEKIT_HAS_CUDA
    {RaggedDotImpl::kCudaSm90Cooperative256, cu::row_grouped_sm90_coop256, on_sm90_bf16,
     kSm90Bf16Needs, sm90_rows_pick_cooperative256},
    {RaggedDotImpl::kCudaSm90Pingpong64x256, cu::row_grouped_sm90_pingpong64, on_sm90_bf16,
     kSm90Bf16Needs, sm90_rows_pick_pingpong64},
    {RaggedDotImpl::kCudaSm90Pingpong, cu::row_grouped_sm90_pingpong, on_sm90_bf16, kSm90Bf16Needs},
    {RaggedDotImpl::kCudaSm90Pingpong64x256Runs, cu::row_grouped_sm90_pingpong64_runs, on_sm90_bf16,
     kSm90Bf16Needs, by_name_only},
    {RaggedDotImpl::kCudaSm90Cooperative256Runs, cu::row_grouped_sm90_coop256_runs, on_sm90_bf16,
     kSm90Bf16Needs, by_name_only},
    {RaggedDotImpl::kCudaSm90, cu::row_grouped_sm90, on_sm90, kSm90Needs},
    {RaggedDotImpl::kCudaSm80, cu::row_grouped_sm80, on_sm80, kSm80Needs},
    {RaggedDotImpl::kCudaPortable, cu::row_grouped_portable, on_cuda, kCudaNeeds},
#endif
    {RaggedDotImpl::kCpuStream, detail::row_grouped_gemm_stream, stream_takes, kStreamNeeds,
     stream_picks},
    {RaggedDotImpl::kOneDnn, detail::row_grouped_gemm_onednn, onednn_takes, kOneDnnNeeds},
    {RaggedDotImpl::kReference, detail::row_grouped_gemm_ref, on_cpu, kCpuNeeds},
};
constexpr Implementation<RaggedDotImpl, ContractionGroupedGemm> kContractionImpls[] = {
#if MOEKIT_HAS_CUDA
    {RaggedDotImpl::kCudaSm90Cooperative256, cu::contraction_grouped_sm90_coop256, on_sm90_bf16,
     kSm90Bf16Needs, sm90_contraction_picks_cooperative256},
    {RaggedDotImpl::kCudaSm90Pingpong, cu::contraction_grouped_sm90_pingpong, on_sm90_bf16,
     kSm90Bf16Needs},
    {RaggedDotImpl::kCudaSm90Pingpong64x256, cu::contraction_grouped_sm90_pingpong64, on_sm90_bf16,
     kSm90Bf16Needs},
    {RaggedDotImpl::kCudaSm90Pingpong64x256Runs, cu::contraction_grouped_sm90_pingpong64_runs,
     on_sm90_bf16, kSm90Bf16Needs, by_name_only},
    {RaggedDotImpl::kCudaSm90Cooperative256Runs, cu::contraction_grouped_sm90_coop256_runs,
     on_sm90_bf16, kSm90Bf16Needs, by_name_only},
    {RaggedDotImpl::kCudaSm90, cu::contraction_grouped_sm90, on_sm90, kSm90Needs},
    {RaggedDotImpl::kCudaSm80, cu::contraction_grouped_sm80, on_sm80, kSm80Needs},
    {RaggedDotImpl::kCudaPortable, cu::contraction_grouped_portable, on_cuda, kCudaNeeds},
#endif
    {RaggedDotImpl::kCpuStream, detail::contraction_grouped_gemm_stream, outer_takes, kOuterNeeds,
     detail::contraction_stream_picks},
    {RaggedDotImpl::kOneDnn, detail::contraction_grouped_gemm_onednn, on_cpu, kCpuNeeds},
    {RaggedDotImpl::kReference, detail::contraction_grouped_gemm_ref, on_cpu, kCpuNeeds},
};

// The backend exists, and the output is apart from the inputs, the groups and the workspace
// (which a CUDA call also writes).
Status check_call(const char* op, const detail::Region& out, const detail::Region& a,
                  const detail::Region& b, const RaggedDotGroups& groups, const Exec& exec) {
  MOEKIT_RETURN_IF_ERROR(detail::check_exec(op, exec));
  return detail::check_disjoint(
      op, {out, {"exec.workspace", exec.workspace, exec.workspace_bytes}},
      {a,
       b,
       {"group_sizes", groups.sizes},
       {"groups.device_offset", groups.device_offset, groups.device_offset ? sizeof(int32_t) : 0}});
}

// The forward and the input gradient.
Status row_grouped(const char* op, const char* a_name, ConstTensorView a, ConstTensorView rhs,
                   const RaggedDotGroups& groups, const char* c_name, TensorView c,
                   const RaggedDotOptions& options, const Exec& exec, bool contract_over_rhs_n) {
  RowGroupedGemm g;
  MOEKIT_RETURN_IF_ERROR(
      detail::row_problem(op, a_name, a, rhs, c_name, c, options, exec, contract_over_rhs_n, &g));
  MOEKIT_RETURN_IF_ERROR(detail::check_groups(op, groups, exec, rhs.shape[0], g.m, &g.groups));
  MOEKIT_RETURN_IF_ERROR(check_call(op, {c_name, c}, {a_name, a}, {"rhs", rhs}, groups, exec));
  return detail::run_implementation(op, kRowImpls, options.impl, g, options.ran);
}

}  // namespace

Status ragged_dot(ConstTensorView lhs, ConstTensorView rhs, const RaggedDotGroups& groups,
                  TensorView out, const RaggedDotOptions& options, const Exec& exec) {
  return row_grouped("ragged_dot", "lhs", lhs, rhs, groups, "out", out, options, exec,
                     /*contract_over_rhs_n=*/false);
}

Status ragged_dot_dlhs(ConstTensorView d_out, ConstTensorView rhs, const RaggedDotGroups& groups,
                       TensorView d_lhs, const RaggedDotOptions& options, const Exec& exec) {
  return row_grouped("ragged_dot_dlhs", "d_out", d_out, rhs, groups, "d_lhs", d_lhs, options, exec,
                     /*contract_over_rhs_n=*/true);
}

Status ragged_dot_drhs(ConstTensorView lhs, ConstTensorView d_out, const RaggedDotGroups& groups,
                       TensorView d_rhs, const RaggedDotOptions& options, const Exec& exec) {
  const char* op = "ragged_dot_drhs";
  ContractionGroupedGemm g;
  MOEKIT_RETURN_IF_ERROR(detail::contraction_problem(op, lhs, d_out, d_rhs, options, exec, &g));
  MOEKIT_RETURN_IF_ERROR(detail::check_groups(op, groups, exec, d_rhs.shape[0], g.m, &g.groups));
  MOEKIT_RETURN_IF_ERROR(
      check_call(op, {"d_rhs", d_rhs}, {"lhs", lhs}, {"d_out", d_out}, groups, exec));
  return detail::run_implementation(op, kContractionImpls, options.impl, g, options.ran);
}

PackedRhsShape packed_rhs_shape(int64_t num_local_groups, int64_t K, int64_t n, DType dtype) {
  constexpr PackedRhsShape kBad{{-1, -1, -1}};
  if (num_local_groups < 0 || K < 0 || n < 0) return kBad;
  if (dtype != DType::kBF16 && dtype != DType::kF32) return kBad;
  const int64_t panels = n / detail::kPackedPanel + (n % detail::kPackedPanel != 0);
  const int64_t w = detail::packed_word_elems(dtype), words = K / w + (K % w != 0);
  int64_t panel_elems = 0, elems = 0;
  if (!detail::mul_fits(words, detail::kPackedPanel * w, &panel_elems) ||
      !detail::mul_fits(panels, panel_elems, &elems) ||
      !detail::mul_fits(num_local_groups, elems, &elems)) {
    return kBad;
  }
  return {{num_local_groups, panels, panel_elems}};
}

namespace {
// pack_ragged_rhs's copy, on elements of type T: each panel's padded contraction row by row.
template <typename T>
void pack_panels(const ConstTensorView& rhs, const TensorView& packed, int k_dim, int n_dim,
                 DType dtype) {
  const int64_t E = packed.shape[0], panels = packed.shape[1], K = rhs.shape[k_dim];
  const int64_t n = rhs.shape[n_dim], sk = rhs.stride[k_dim], sn = rhs.stride[n_dim];
  const int64_t padded_k = packed.shape[2] / detail::kPackedPanel;
  const auto* w = static_cast<const T*>(rhs.data);
  auto* out = static_cast<T*>(packed.data);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t j = 0; j < E; ++j) {
    for (int64_t p = 0; p < panels; ++p) {
      const T* from = w + j * rhs.stride[0];
      T* to = out + j * packed.stride[0] + p * packed.stride[1];
      for (int64_t k = 0; k < padded_k; ++k) {
        for (int64_t c = 0; c < detail::kPackedPanel; ++c) {
          const int64_t col = p * detail::kPackedPanel + c;
          to[detail::packed_b_offset(0, k, c, dtype)] =
              k < K && col < n ? from[k * sk + col * sn] : T{0};
        }
      }
    }
  }
}
}  // namespace

Status pack_ragged_rhs(ConstTensorView rhs, TensorView packed, const RaggedDotOptions& options,
                       const Exec& exec) {
  const char* op = "pack_ragged_rhs";
  MOEKIT_RETURN_IF_ERROR(detail::check_exec(op, exec));
  if (exec.device != Device::kCpu) {
    return Status::unimplemented(op, "exec.device = kCuda: packed weights are the CPU's");
  }
  MOEKIT_RETURN_IF_ERROR(detail::check_view(op, "rhs", rhs, 3));
  MOEKIT_RETURN_IF_ERROR(detail::check_view(op, "packed", packed, 3));
  if (rhs.dtype != DType::kBF16 && rhs.dtype != DType::kF32) {
    return Status::invalid_argument(op, "rhs.dtype", std::string(dtype_name(rhs.dtype)),
                                    "packed weights are bf16 or f32");
  }
  MOEKIT_RETURN_IF_ERROR(detail::check_dtype(op, "packed", packed.dtype, rhs.dtype));
  const int k_dim = options.rhs_transposed ? 2 : 1, n_dim = options.rhs_transposed ? 1 : 2;
  const int64_t E = rhs.shape[0], K = rhs.shape[k_dim], n = rhs.shape[n_dim];
  const PackedRhsShape want = packed_rhs_shape(E, K, n, rhs.dtype);
  for (int d = 0; d < 3; ++d) {
    if (packed.shape[d] != want.dims[d]) {
      return Status::invalid_argument(
          op, fmt::format("packed.shape[{}]", d), std::to_string(packed.shape[d]),
          fmt::format("rhs of {} groups of K = {}, n = {} ({}) packs into [{}, {}, {}] "
                      "(packed_rhs_shape)",
                      E, K, n, dtype_name(rhs.dtype), want.dims[0], want.dims[1], want.dims[2]));
    }
  }
  MOEKIT_RETURN_IF_ERROR(detail::check_disjoint(op, {{"packed", packed}}, {{"rhs", rhs}}));
  if (rhs.dtype == DType::kF32) {
    pack_panels<float>(rhs, packed, k_dim, n_dim, rhs.dtype);
  } else {
    pack_panels<bf16_bits>(rhs, packed, k_dim, n_dim, rhs.dtype);
  }
  return {};
}

size_t ragged_dot_workspace_size(Device device, int64_t num_local_groups) {
  if (device != Device::kCuda) return 0;
#if MOEKIT_HAS_CUDA
  size_t bytes = cu::portable_workspace_size(num_local_groups);
  cu::DeviceInfo info;
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

int64_t ragged_dot_flops(std::span<const int32_t> group_sizes, int32_t group_offset,
                         int64_t num_local_groups, int64_t K, int64_t n) {
  if (group_offset < 0 || num_local_groups < 0 || K < 0 || n < 0) return -1;
  int64_t rows = 0, flops = 0;
  for (size_t j = static_cast<size_t>(group_offset);
       j < group_sizes.size() && static_cast<int64_t>(j) - group_offset < num_local_groups; ++j) {
    if (group_sizes[j] < 0 || __builtin_add_overflow(rows, group_sizes[j], &rows)) return -1;
  }
  if (!detail::mul_fits(rows, 2, &flops) || !detail::mul_fits(flops, K, &flops) ||
      !detail::mul_fits(flops, n, &flops)) {
    return -1;
  }
  return flops;
}

bool cuda_built() { return MOEKIT_HAS_CUDA != 0; }

#if !MOEKIT_HAS_CUDA
int cuda_device_count() { return 0; }
#endif  // else in cuda/common.cu

const char* impl_name(RaggedDotImpl impl) {
  switch (impl) {
    case RaggedDotImpl::kAuto:
      return "auto";
    case RaggedDotImpl::kOneDnn:
      return "onednn";
    case RaggedDotImpl::kReference:
      return "reference";
    case RaggedDotImpl::kCudaSm90:
      return "sm90";
    case RaggedDotImpl::kCudaSm80:
      return "sm80";
    case RaggedDotImpl::kCudaPortable:
      return "portable";
    case RaggedDotImpl::kCpuStream:
      return "stream";
    case RaggedDotImpl::kCudaSm90Pingpong:
      return "sm90-pingpong";
    case RaggedDotImpl::kCudaSm90Cooperative256:
      return "sm90-cooperative-256";
    case RaggedDotImpl::kCudaSm90Pingpong64x256:
      return "sm90-pingpong-64x256";
    case RaggedDotImpl::kCudaSm90Pingpong64x256Runs:
      return "sm90-pingpong-64x256-runs";
    case RaggedDotImpl::kCudaSm90Cooperative256Runs:
      return "sm90-cooperative-256-runs";
  }
  return "unknown";
}

}  // namespace moekit
