// Helpers shared by the `moekit bench` harnesses: buffers, seeded data, group sizes, timing,
// progress on stderr, and ASCII charts.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moekit/dtype.h"
#include "moekit/status.h"

namespace CLI {
class App;
class Validator;
}  // namespace CLI

namespace moekit::tools {

// The options every `moekit bench OP` takes; a bench's own options derive from it.
struct BenchOptions {
  std::string preset;
  std::vector<int64_t> tokens;
  std::string dtype;
  bool json = false;
  int warmup = 3, reps = 15;
  uint64_t seed = 42;
  double mem_limit_gib = 16;   // the most the bench's Buffers may hold at once
  bool huge_pages = false;     // Buffers advised to take transparent huge pages
  std::string device = "cpu";  // where the bench runs, for those with --device (bench_device.h)
};

// Adds --preset, --tokens, --dtype, --json, --warmup, --reps, --seed, --mem-limit-gib and
// --huge-pages to cmd, bound to o, whose values on entry are the defaults shown, each validated
// with a message that names it. dtype_help says what --dtype applies to; mem_help what the bench
// does with a case over the memory limit (any Buffer past it is refused in any case, see Buffer).
void add_bench_options(CLI::App& cmd, BenchOptions& o, const std::string& dtype_help,
                       const std::string& mem_help = "Refuse a case whose buffers exceed this");

// Validators whose messages name the accepted values in words: a whole number in [lo, hi], and
// a finite number > 0.
CLI::Validator integer_in(int64_t lo, int64_t hi, const std::string& what);
CLI::Validator positive_number(const std::string& what);

// A 64-byte aligned heap buffer. Buffers together hold at most --mem-limit-gib: one that would
// take them past it is refused before it allocates (a std::runtime_error naming the limit). With
// --huge-pages (set_huge_pages), buffers of 2 MiB or more are 2 MiB aligned and advised to take
// transparent huge pages (madvise MADV_HUGEPAGE; the kernel's
// /sys/kernel/mm/transparent_hugepage/enabled must say always or madvise).
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t bytes);
  void* data() { return p_.get(); }
  const void* data() const { return p_.get(); }
  size_t bytes() const { return bytes_; }

 private:
  struct Free {
    Free() : bytes(0) {}  // (not a default member initializer: Buffer() needs Free() early)
    explicit Free(size_t b) : bytes(b) {}
    size_t bytes;  // counted against the limit, returned when freed
    void operator()(void* p) const;
  };
  std::unique_ptr<void, Free> p_;
  size_t bytes_ = 0;
};

// The limit Buffers share, in GiB (set from --mem-limit-gib when a bench's options are parsed).
void set_memory_limit_gib(double gib);
// Whether Buffers from now on are advised to take huge pages (set from --huge-pages), and whether
// they are.
void set_huge_pages(bool on);
bool huge_pages();
// Counts `bytes` of other memory (a device's) against that limit: a std::runtime_error naming it
// when they would pass it; release_bytes gives them back.
void hold_bytes(size_t bytes);
void release_bytes(size_t bytes);
// The bytes counted against the limit now (live Buffers and held_bytes).
size_t held_bytes();

// n values uniform in [-1, 1), rounded to bf16 so that f32 and bf16 runs see the same numbers.
// Deterministic for a seed whatever the thread count.
void fill_uniform(void* p, DType t, int64_t n, uint64_t seed);

// Splits `rows` over `groups`: group e gets weight 1 + imbalance * u_e, u_e ~ U(-1, 1) from
// `seed`, sizes proportional to the weights, rounded down, the remainder one row each to the
// groups in order. Sums to exactly `rows`.
std::vector<int32_t> imbalanced_group_sizes(int64_t rows, int64_t groups, double imbalance,
                                            uint64_t seed);

struct Timing {
  double median_ms = 0, min_ms = 0;
};

// The median and minimum of some times (ms); zeros for none.
Timing summarize(std::vector<double> ms);

// Times several functions run by run, alternating f0, f1, ..., f0, f1, ... after `warmup`
// rounds, so that all of them see the same machine state (these machines are noisy). Returns
// the median and minimum of each, in order.
std::vector<Timing> time_interleaved(int warmup, int reps,
                                     const std::vector<std::function<void()>>& fns);

// "[ 3/12] label" on stderr, rewritten in place on a terminal, one line each otherwise.
class Progress {
 public:
  explicit Progress(int total);
  void step(const std::string& label);
  void finish();

 private:
  int total_, done_ = 0;
  bool tty_;
};

// Horizontal bars, one per row: "label | ######      value unit".
std::string ascii_bars(const std::vector<std::string>& labels, const std::vector<double>& values,
                       const std::string& unit, int width = 50);

// "bf16" | "f32" (and "f16" where allow_f16) as a DType; anything else is a
// CLI::ValidationError naming `flag`.
DType parse_dtype(const std::string& s, const std::string& flag = "--dtype",
                  bool allow_f16 = false);

// Throws std::runtime_error with the message when a moekit call fails.
void check(const Status& s);

// Copies `bytes` from src to dst with every OpenMP thread taking one contiguous slice: the
// bandwidth reference the memory-bound kernels are measured against (both cores busy).
void parallel_copy(void* dst, const void* src, size_t bytes);

// Reads `bytes` at src (summing them as 64-bit words into a sink) with every OpenMP thread taking
// one contiguous slice, read as `streams` streams side by side: the ceiling of a kernel that
// mostly reads, where a copy's mix of reads and streamed writes can move more bytes per second
// than reads alone. Which count reads fastest depends on the CPU, so the floor's read rate is the
// faster of one stream a thread and kReadStreams (FloorRead). On an Intel Xeon with AMX, 2 cores,
// a 1 GiB read ran 23-24 GB/s as one stream a thread, 27-30 as 4, 27-29 as 8 to 32 (best of 3,
// three rounds; bench/results/read-probe-cpu-2026-11-28), where the AMX contraction-contiguous
// form (the forward on [E, n, K] weights) read qwen3-30b-a3b's and mixtral-8x7b's weights at
// 26-27; on an AMD EPYC with Zen 4 cores, 2 cores, 4-15 GiB read at 30-46 GB/s as one stream a
// thread and 18-25 as 4 in the same loop (bench/results/read-probe-cpu-2026-11-29).
inline constexpr size_t kReadStreams = 4;
void parallel_read(const void* src, size_t bytes, size_t streams = kReadStreams);

// "AMD EPYC (2 cores, 2 OpenMP threads)" from /proc/cpuinfo and the runtime.
std::string machine_description();
std::string today_iso();

}  // namespace moekit::tools
