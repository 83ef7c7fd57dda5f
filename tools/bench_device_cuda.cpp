// The CUDA BenchDevice (bench_device.h): device memory from cudaMalloc, seeded values uploaded
// from the host, every call and reference on one non-blocking stream, timed with a pair of CUDA
// events per run; the references cudaMemcpyAsync (device to device) and cublasGemmEx with f32
// compute.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <stdexcept>
#include <string>

#include "bench_device.h"
#include "moekit/ragged_dot.h"

namespace moekit::tools {
namespace {

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw std::runtime_error(fmt::format("{}: {}", what, cudaGetErrorString(e)));
  }
}
void cublas_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(fmt::format("{}: cuBLAS status {}", what, static_cast<int>(s)));
  }
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

// Row-major C [M, N] = op(A) @ op(B) through column-major cuBLAS: C^T = op(B)^T op(A)^T.
class CublasDense : public DenseRef {
 public:
  CublasDense(cublasHandle_t h, DType in, DType out, int64_t M, int64_t K, int64_t N, bool a_t,
              bool b_t)
      : h_(h), in_(in), out_(out), M_(M), K_(K), N_(N), a_t_(a_t), b_t_(b_t) {}
  void run(const void* a, const void* b, void* c) override {
    const float one = 1.0f, zero = 0.0f;
    cublas_check(
        cublasGemmEx(h_, b_t_ ? CUBLAS_OP_T : CUBLAS_OP_N, a_t_ ? CUBLAS_OP_T : CUBLAS_OP_N,
                     static_cast<int>(N_), static_cast<int>(M_), static_cast<int>(K_), &one, b,
                     cuda_type(in_), static_cast<int>(b_t_ ? K_ : N_), a, cuda_type(in_),
                     static_cast<int>(a_t_ ? M_ : K_), &zero, c, cuda_type(out_),
                     static_cast<int>(N_), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx");
  }
  const std::string& impl() const override { return impl_; }

 private:
  cublasHandle_t h_;
  DType in_, out_;
  int64_t M_, K_, N_;
  bool a_t_, b_t_;
  std::string impl_ = "cuBLAS cublasGemmEx, f32 compute";
};

class CudaBenchDevice : public BenchDevice {
 public:
  CudaBenchDevice() {
    if (cuda_device_count() == 0) {
      throw std::runtime_error("--device cuda: no CUDA device");
    }
    int device = 0, driver = 0;
    cuda_check(cudaGetDevice(&device), "cudaGetDevice");
    cudaDeviceProp prop{};
    cuda_check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    cuda_check(cudaDriverGetVersion(&driver), "cudaDriverGetVersion");
    description_ =
        fmt::format("{} ({} SMs, {:.0f} GiB, compute capability {}.{}, CUDA driver {}.{})",
                    prop.name, prop.multiProcessorCount, prop.totalGlobalMem / double(1ull << 30),
                    prop.major, prop.minor, driver / 1000, driver % 1000 / 10);
    cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    cublas_check(cublasCreate(&cublas_), "cublasCreate");
    cublas_check(cublasSetStream(cublas_, stream_), "cublasSetStream");
  }
  ~CudaBenchDevice() override {
    cublasDestroy(cublas_);
    cudaStreamDestroy(stream_);
  }
  Device device() const override { return Device::kCuda; }
  std::string description() const override { return description_; }
  Mem alloc(size_t bytes) override {
    const size_t n = std::max<size_t>(bytes, 1);
    hold_bytes(n);
    void* p = nullptr;
    if (cudaMalloc(&p, n) != cudaSuccess) {
      release_bytes(n);
      throw std::runtime_error(fmt::format("cudaMalloc of {} bytes failed", n));
    }
    return Mem(std::shared_ptr<void>(p,
                                     [n](void* q) {
                                       cudaFree(q);
                                       release_bytes(n);
                                     }),
               bytes);
  }
  void fill(void* dst, DType t, int64_t n, uint64_t seed) override {
    Buffer host(static_cast<size_t>(n) * dtype_size(t));
    fill_uniform(host.data(), t, n, seed);
    upload(dst, host.data(), host.bytes());
  }
  // On the calls' stream, and landed on return: a cudaMemcpy from pageable memory may return
  // before its DMA ends, and the non-blocking stream would not wait for it.
  void upload(void* dst, const void* host, size_t bytes) override {
    cuda_check(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream_), "upload");
    cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }
  void to_host(void* host, const void* src, size_t bytes) override {
    cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    cuda_check(cudaMemcpy(host, src, bytes, cudaMemcpyDeviceToHost), "download");
  }
  Exec exec(const Mem& workspace) const override {
    return Exec{Device::kCuda, stream_, workspace.data(), workspace.bytes()};
  }
  std::vector<Timing> time(int warmup, int reps,
                           const std::vector<std::function<void()>>& fns) override {
    for (int w = 0; w < warmup; ++w) {
      for (const auto& f : fns) f();
    }
    std::vector<cudaEvent_t> events(2 * fns.size() * reps);
    for (auto& e : events) cuda_check(cudaEventCreate(&e), "cudaEventCreate");
    for (int r = 0; r < reps; ++r) {
      for (size_t i = 0; i < fns.size(); ++i) {
        const size_t at = 2 * (r * fns.size() + i);
        cuda_check(cudaEventRecord(events[at], stream_), "cudaEventRecord");
        fns[i]();
        cuda_check(cudaEventRecord(events[at + 1], stream_), "cudaEventRecord");
      }
    }
    cuda_check(cudaStreamSynchronize(stream_), "the timed runs");
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
  void copy(void* dst, const void* src, size_t bytes) override {
    cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_),
               "cudaMemcpyAsync");
  }
  bool has_read() const override { return false; }
  void read(const void*, size_t, size_t) override {}
  std::string copy_description() const override {
    return "cudaMemcpyAsync of the same bytes (half read, half written, device to device) on the "
           "same stream";
  }
  std::unique_ptr<DenseRef> dense(DType in, DType out, int64_t M, int64_t K, int64_t N, bool a_t,
                                  bool b_t) override {
    return std::make_unique<CublasDense>(cublas_, in, out, M, K, N, a_t, b_t);
  }
  bool profile_in_timed_runs() const override { return false; }

 private:
  std::string description_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
};

}  // namespace

std::unique_ptr<BenchDevice> make_cuda_bench_device() {
  return std::make_unique<CudaBenchDevice>();
}

}  // namespace moekit::tools
