// moekit bench ragged_dot --device cuda: the three passes on the GPU, each beside a cuBLAS
// matmul of all m rows with the same FLOPs and operand layouts, and one shard's call beside the
// full call; every run timed with a pair of CUDA events on one stream, runs alternating.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_ragged_dot.h"
#include "moekit/ragged_dot.h"

namespace moekit::tools {
namespace {

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(fmt::format("{}: {}", what, cudaGetErrorString(e)));
}
void cublas_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(fmt::format("{}: cuBLAS status {}", what, static_cast<int>(s)));
  }
}

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) {
    cuda_check(cudaMalloc(&p_, std::max<size_t>(bytes, 1)), "cudaMalloc");
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(p_); }
  void* data() const { return p_; }

 private:
  void* p_ = nullptr;
};

// A device buffer of n values from fill_uniform (the CPU bench's numbers).
void upload_uniform(void* dst, DType t, int64_t n, uint64_t seed) {
  Buffer host(static_cast<size_t>(n) * dtype_size(t));
  fill_uniform(host.data(), t, n, seed);
  cuda_check(cudaMemcpy(dst, host.data(), host.bytes(), cudaMemcpyHostToDevice), "upload");
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kF32:
      return CUDA_R_32F;
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF16:
      return CUDA_R_16F;
    default:
      throw std::runtime_error("no cuBLAS type for " + std::string(dtype_name(t)));
  }
}

// A row-major C [M, N] = A [M, Kc] @ B [Kc, N] through column-major cuBLAS: C^T = B^T A^T.
// a_transposed: A is stored as [Kc, M]; b_transposed: B is stored as [N, Kc].
struct DenseGemm {
  cublasHandle_t handle;
  DType in, out;
  int64_t M, N, Kc;
  bool a_transposed, b_transposed;
  void run(const void* a, const void* b, void* c) const {
    const float one = 1.0f, zero = 0.0f;
    cublas_check(cublasGemmEx(handle, b_transposed ? CUBLAS_OP_T : CUBLAS_OP_N,
                              a_transposed ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(N),
                              static_cast<int>(M), static_cast<int>(Kc), &one, b, cuda_type(in),
                              static_cast<int>(b_transposed ? Kc : N), a, cuda_type(in),
                              static_cast<int>(a_transposed ? M : Kc), &zero, c, cuda_type(out),
                              static_cast<int>(N), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx");
  }
};

// Times each function `reps` times after `warmup` rounds, alternating, with CUDA events.
std::vector<Timing> time_events(int warmup, int reps, const std::vector<std::function<void()>>& fns,
                                cudaStream_t stream) {
  for (int w = 0; w < warmup; ++w) {
    for (const auto& f : fns) f();
  }
  std::vector<cudaEvent_t> events(2 * fns.size() * reps);
  for (auto& e : events) cuda_check(cudaEventCreate(&e), "cudaEventCreate");
  for (int r = 0; r < reps; ++r) {
    for (size_t i = 0; i < fns.size(); ++i) {
      const size_t at = 2 * (r * fns.size() + i);
      cuda_check(cudaEventRecord(events[at], stream), "cudaEventRecord");
      fns[i]();
      cuda_check(cudaEventRecord(events[at + 1], stream), "cudaEventRecord");
    }
  }
  cuda_check(cudaStreamSynchronize(stream), "the timed runs");
  std::vector<Timing> out;
  for (size_t i = 0; i < fns.size(); ++i) {
    std::vector<double> ms;
    for (int r = 0; r < reps; ++r) {
      const size_t at = 2 * (r * fns.size() + i);
      float t = 0;
      cuda_check(cudaEventElapsedTime(&t, events[at], events[at + 1]), "cudaEventElapsedTime");
      ms.push_back(t);
    }
    out.push_back(summarize(ms));
  }
  for (auto& e : events) cudaEventDestroy(e);
  return out;
}

}  // namespace

std::string time_ragged_dot_cuda(const RaggedDotBenchOptions& o, const Preset& p, DType in,
                                 DType out, int shard, std::FILE* text, Progress& progress,
                                 std::vector<RaggedDotRow>& rows) {
  if (cuda_device_count() == 0) {
    throw std::runtime_error("--device cuda: no CUDA device (or a build without MOEKIT_CUDA)");
  }
  int device = 0, driver = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  cudaDeviceProp prop{};
  cuda_check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  cuda_check(cudaDriverGetVersion(&driver), "cudaDriverGetVersion");
  // The sm90 family bf16 calls run (a tuning knob of src/cuda/sm90_grouped_gemm.cu, in builds
  // with MOEKIT_CUDA_SM90_CANDIDATES).
  const char* sm90_kernel = std::getenv("MOEKIT_CUDA_SM90_KERNEL");
  const std::string machine = fmt::format(
      "{} ({} SMs, {:.0f} GiB, compute capability {}.{}, CUDA driver {}.{}; sm90 bf16 kernel {})",
      prop.name, prop.multiProcessorCount, prop.totalGlobalMem / double(1ull << 30), prop.major,
      prop.minor, driver / 1000, driver % 1000 / 10,
      sm90_kernel && *sm90_kernel ? sm90_kernel : "cooperative");

  cudaStream_t stream;
  cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  cublasHandle_t handle;
  cublas_check(cublasCreate(&handle), "cublasCreate");
  cublas_check(cublasSetStream(handle, stream), "cublasSetStream");
  const size_t in_es = dtype_size(in), out_es = dtype_size(out);

  for (int64_t T : o.tokens) {
    const RaggedDotProblem pr = ragged_dot_problem(p, T, in, out, o, text);
    const int64_t m = pr.m, E = pr.E, K = pr.K, n = pr.n;
    DeviceBuffer lhs(m * K * in_es), rhs(E * K * n * in_es), d_out(m * n * in_es);
    DeviceBuffer y(m * n * out_es), d_lhs(m * K * out_es), d_rhs(E * K * n * out_es);
    upload_uniform(lhs.data(), in, m * K, o.seed + 1);
    upload_uniform(rhs.data(), in, E * K * n, o.seed + 2);
    upload_uniform(d_out.data(), in, m * n, o.seed + 3);
    DeviceBuffer sizes(pr.sizes.size() * sizeof(int32_t));
    cuda_check(cudaMemcpy(sizes.data(), pr.sizes.data(), pr.sizes.size() * sizeof(int32_t),
                          cudaMemcpyHostToDevice),
               "upload sizes");
    const size_t ws_bytes = ragged_dot_workspace_size(Device::kCuda, E);
    DeviceBuffer workspace(ws_bytes);
    const RaggedDotExec exec{Device::kCuda, stream, workspace.data(), ws_bytes};
    const std::span<const int32_t> device_sizes(static_cast<const int32_t*>(sizes.data()),
                                                pr.sizes.size());
    const ConstTensorView lhs_v(lhs.data(), in, {m, K}), d_out_v(d_out.data(), in, {m, n});
    const TensorView y_v(y.data(), out, {m, n}), d_lhs_v(d_lhs.data(), out, {m, K});

    for (const std::string pass : {"fwd", "dlhs", "drhs"}) {
      auto call = [&](int64_t e_loc, int32_t offset, const RaggedDotOptions& opt) {
        const RaggedDotGroups groups{device_sizes, offset};
        const ConstTensorView w(rhs.data(), in, {e_loc, K, n});
        if (pass == "fwd") return ragged_dot(lhs_v, w, groups, y_v, opt, exec);
        if (pass == "dlhs") return ragged_dot_dlhs(d_out_v, w, groups, d_lhs_v, opt, exec);
        return ragged_dot_drhs(lhs_v, d_out_v, groups, TensorView(d_rhs.data(), out, {e_loc, K, n}),
                               opt, exec);
      };
      // The dense matmul of all m rows with the pass's operand layouts (one weight matrix).
      DenseGemm dense{handle, in, out, m, n, K, false, false};
      const void *da = lhs.data(), *db = rhs.data();
      void* dc = y.data();
      if (pass == "dlhs") {  // [m, n] @ rhs[0]^T, rhs[0] stored [K, n]
        dense = {handle, in, out, m, K, n, false, true};
        da = d_out.data(), dc = d_lhs.data();
      } else if (pass == "drhs") {  // lhs^T [K, m] @ d_out [m, n], lhs stored [m, K]
        dense = {handle, in, out, K, n, m, true, false};
        db = d_out.data(), dc = d_rhs.data();
      }
      time_pass(
          o, pr, shard, full_row(pass, pr, "cuBLAS cublasGemmEx, f32 compute"), call,
          [&] { dense.run(da, db, dc); },
          [&](const auto& fns) { return time_events(o.warmup, o.reps, fns, stream); },
          fmt::format("{} T={} {}: ragged_dot, cuBLAS", p.name, T, pass), progress, rows);
    }
  }
  cublasDestroy(handle);
  cudaStreamDestroy(stream);
  return machine;
}

}  // namespace moekit::tools
