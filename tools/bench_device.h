// Where a bench runs (--device cpu | cuda): its memory, its clock and its references. The router,
// permute and layer benches are written once over this; only what differs by device is here:
//   cpu   host buffers, wall clock; references: a copy and a read of the same bytes split over
//         all threads, a dense oneDNN matmul;
//   cuda  device buffers, CUDA events on one stream; references: cudaMemcpyAsync of the same
//         bytes (device to device), a dense cuBLAS matmul (bench_device_cuda.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.h"
#include "moekit/dtype.h"
#include "moekit/exec.h"
#include "moekit/router.h"

namespace moekit::tools {

// Memory of a device, freed with the last copy of its handle.
class Mem {
 public:
  Mem() = default;
  Mem(std::shared_ptr<void> owner, size_t bytes)
      : data_(owner.get()), bytes_(bytes), owner_(std::move(owner)) {}
  void* data() const { return data_; }
  std::byte* bytes_data() const { return static_cast<std::byte*>(data_); }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  std::shared_ptr<void> owner_;
};

// A dense matmul C [M, N] = op(A) [M, K] @ op(B) [K, N], row-major, A stored [K, M] when
// a_transposed and B stored [N, K] when b_transposed: the grouped matmuls' reference.
class DenseRef {
 public:
  virtual ~DenseRef() = default;
  virtual void run(const void* a, const void* b, void* c) = 0;
  virtual const std::string& impl() const = 0;
};

class BenchDevice {
 public:
  virtual ~BenchDevice() = default;
  virtual Device device() const = 0;
  // The machine, for a table's heading: "AMD EPYC (2 cores, ...)", "NVIDIA H100 (132 SMs, ...)".
  virtual std::string description() const = 0;
  // `bytes` of this device's memory (at least 1), counted against --mem-limit-gib as Buffers are.
  virtual Mem alloc(size_t bytes) = 0;
  // n values of fill_uniform(seed) in dtype t, into this device's memory at dst.
  virtual void fill(void* dst, DType t, int64_t n, uint64_t seed) = 0;
  virtual void upload(void* dst, const void* host, size_t bytes) = 0;
  virtual void to_host(void* host, const void* src, size_t bytes) = 0;
  // The ops' execution context here, with `workspace` as their scratch.
  virtual Exec exec(const Mem& workspace = {}) const = 0;
  // Times fns run by run, alternating, after `warmup` rounds; the median and minimum of each.
  virtual std::vector<Timing> time(int warmup, int reps,
                                   const std::vector<std::function<void()>>& fns) = 0;
  // The memory-bound references: a copy of `bytes` from src to dst; a read of `bytes` at src as
  // `streams` streams a thread (parallel_read) where the device has one (has_read).
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual bool has_read() const = 0;
  virtual void read(const void* src, size_t bytes, size_t streams = kReadStreams) = 0;
  virtual std::string copy_description() const = 0;
  virtual std::unique_ptr<DenseRef> dense(DType in, DType out, int64_t M, int64_t K, int64_t N,
                                          bool a_transposed = false, bool b_transposed = false) = 0;
  // Whether the layer's per-step profile may be taken in its timed runs: on the CPU it costs a
  // clock read per step; on a GPU it waits for the stream around every step, so it is taken in
  // runs of its own.
  virtual bool profile_in_timed_runs() const = 0;
};

// The read of a floor's read rate (issue 35; CPU): a plain parallel read of the weights' own
// buffers where together they hold at least read_probe_bytes(), else of the probe, timed twice in
// the loop, as each of kFloorReadStreams streams a thread (the faster is the rate: which reads
// faster depends on the CPU, parallel_read says); and after them, untimed, a read of the probe, so
// that no weights stay cached for the next call. In a VM where a buffer lands decides its read
// rate (a process's buffers of 256 MiB read at 21-30 GB/s by where they fall,
// bench/results/ragged_dot_small-cpu-2026-11-27-6/by-hand/read_placement.txt), a probe apart from
// the weights could say 1.4x more or less than their own memory gives.
inline constexpr size_t kFloorReadStreams[] = {1, kReadStreams};
// Of dev.time's timings, the faster of the reads timed as each of kFloorReadStreams, from t[at].
Timing faster_read(const std::vector<Timing>& t, size_t at);
struct FloorRead {
  std::vector<const Mem*> timed;  // read one after another; the rate's bytes
  const Mem* evict = nullptr;     // read after them, untimed (none when the probe is timed)
  double bytes() const;
  // fns' parts of dev.time's loop: the timed reads (one per kFloorReadStreams), then (if any) the
  // untimed one.
  void add_to(BenchDevice& dev, std::vector<std::function<void()>>& fns) const;
  // The read rate in GB/s from dev.time's timings, add_to's parts from t[at]: the faster read's.
  double gbps(const std::vector<Timing>& t, size_t at) const;
};
FloorRead floor_read(const std::vector<const Mem*>& weights, const Mem& probe);

// "cpu" or "cuda" (a CLI::ValidationError naming --device otherwise; a std::runtime_error for
// cuda without a device, or in a build without CUDA).
std::unique_ptr<BenchDevice> make_bench_device(const std::string& name);
std::unique_ptr<BenchDevice> make_cpu_bench_device();
std::unique_ptr<BenchDevice> make_cuda_bench_device();  // bench_device_cuda.cpp (or its stub)

// Adds --device (cpu | cuda) to cmd, bound to `device`.
void add_device_option(CLI::App& cmd, std::string& device);

// Adds --cache-mib: the last-level cache size the cold mode and the read probe are sized against
// (set_last_level_cache_bytes), for machines that report their host's cache.
void add_cache_size_option(CLI::App& cmd);

// The expert bias of router options moved into dev's memory (held by the returned Mem), the
// options pointing at it; nothing without a bias.
Mem place_expert_bias(BenchDevice& dev, RouteOptions& ro);

}  // namespace moekit::tools
