#include "bench_device.h"

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstring>
#include <iterator>
#include <stdexcept>

#include "dense_matmul.h"
#include "roofline.h"

namespace moekit::tools {
namespace {

class CpuDense : public DenseRef {
 public:
  CpuDense(DType in, DType out, int64_t M, int64_t K, int64_t N, bool a_t, bool b_t)
      : mm_(in, out, M, K, N, a_t ? dnnl::memory::dims{1, M} : dnnl::memory::dims{K, 1},
            b_t ? dnnl::memory::dims{1, K} : dnnl::memory::dims{N, 1}),
        impl_("oneDNN " + mm_.impl()) {}
  void run(const void* a, const void* b, void* c) override { mm_.run(a, b, c); }
  const std::string& impl() const override { return impl_; }

 private:
  DenseMatmul mm_;
  std::string impl_;
};

class CpuBenchDevice : public BenchDevice {
 public:
  Device device() const override { return Device::kCpu; }
  std::string description() const override { return machine_description(); }
  Mem alloc(size_t bytes) override {
    auto buffer = std::make_shared<Buffer>(std::max<size_t>(bytes, 1));
    void* data = buffer->data();
    return Mem(std::shared_ptr<void>(buffer, data), bytes);
  }
  void fill(void* dst, DType t, int64_t n, uint64_t seed) override {
    fill_uniform(dst, t, n, seed);
  }
  void upload(void* dst, const void* host, size_t bytes) override { std::memcpy(dst, host, bytes); }
  void to_host(void* host, const void* src, size_t bytes) override {
    std::memcpy(host, src, bytes);
  }
  Exec exec(const Mem& workspace) const override {
    return Exec{Device::kCpu, nullptr, workspace.data(), workspace.bytes()};
  }
  std::vector<Timing> time(int warmup, int reps,
                           const std::vector<std::function<void()>>& fns) override {
    return time_interleaved(warmup, reps, fns);
  }
  void copy(void* dst, const void* src, size_t bytes) override { parallel_copy(dst, src, bytes); }
  bool has_read() const override { return true; }
  void read(const void* src, size_t bytes, size_t streams) override {
    parallel_read(src, bytes, streams);
  }
  std::string copy_description() const override {
    return "a copy of the same bytes (half read, half written) and a read of them, each split "
           "over all threads (the read timed as 1 and as 4 streams a thread, the faster kept)";
  }
  std::unique_ptr<DenseRef> dense(DType in, DType out, int64_t M, int64_t K, int64_t N, bool a_t,
                                  bool b_t) override {
    return std::make_unique<CpuDense>(in, out, M, K, N, a_t, b_t);
  }
  bool profile_in_timed_runs() const override { return true; }
};

}  // namespace

std::unique_ptr<BenchDevice> make_cpu_bench_device() { return std::make_unique<CpuBenchDevice>(); }

double FloorRead::bytes() const {
  double b = 0;
  for (const Mem* m : timed) b += static_cast<double>(m->bytes());
  return b;
}

void FloorRead::add_to(BenchDevice& dev, std::vector<std::function<void()>>& fns) const {
  for (const size_t streams : kFloorReadStreams) {
    fns.push_back([this, &dev, streams] {
      for (const Mem* m : timed) dev.read(m->data(), m->bytes(), streams);
    });
  }
  if (evict != nullptr) fns.push_back([this, &dev] { dev.read(evict->data(), evict->bytes()); });
}

Timing faster_read(const std::vector<Timing>& t, size_t at) {
  Timing fastest = t.at(at);
  for (size_t i = 1; i < std::size(kFloorReadStreams); ++i) {
    if (t.at(at + i).median_ms < fastest.median_ms) fastest = t.at(at + i);
  }
  return fastest;
}

double FloorRead::gbps(const std::vector<Timing>& t, size_t at) const {
  return bytes() / (faster_read(t, at).median_ms * 1e6);
}

FloorRead floor_read(const std::vector<const Mem*>& weights, const Mem& probe) {
  FloorRead own{weights, &probe};
  if (own.bytes() >= static_cast<double>(read_probe_bytes())) return own;
  return {{&probe}, nullptr};
}

std::unique_ptr<BenchDevice> make_bench_device(const std::string& name) {
  if (name == "cpu") return make_cpu_bench_device();
  if (name == "cuda") return make_cuda_bench_device();
  throw CLI::ValidationError("--device", "expected cpu or cuda, got '" + name + "'");
}

void add_device_option(CLI::App& cmd, std::string& device) {
  cmd.add_option("--device", device,
                 "Where the buffers live and the calls run: cpu | cuda (the current GPU, timed "
                 "with CUDA events beside cudaMemcpyAsync and cuBLAS)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
}

void add_cache_size_option(CLI::App& cmd) {
  cmd.add_option_function<int64_t>(
         "--cache-mib",
         [](int64_t mib) { set_last_level_cache_bytes(static_cast<size_t>(mib) << 20); },
         fmt::format("The last-level cache in MiB that the cold weights' copies and the read "
                     "rate's probe are sized against (default: what the machine reports, {})",
                     last_level_cache_bytes() >> 20))
      ->check(integer_in(1, int64_t{1} << 30, "a whole number of MiB in [1, 2^30]"));
}

Mem place_expert_bias(BenchDevice& dev, RouteOptions& ro) {
  if (ro.expert_bias.empty()) return {};
  Mem m = dev.alloc(ro.expert_bias.size_bytes());
  dev.upload(m.data(), ro.expert_bias.data(), ro.expert_bias.size_bytes());
  ro.expert_bias = {static_cast<const float*>(m.data()), ro.expert_bias.size()};
  return m;
}

#if !MOEKIT_TOOL_CUDA
std::unique_ptr<BenchDevice> make_cuda_bench_device() {
  throw std::runtime_error("--device cuda: this moekit was built without its CUDA backend");
}
#endif

}  // namespace moekit::tools
