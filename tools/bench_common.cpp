#include "bench_common.h"

#include <fmt/format.h>
#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <random>
#include <stdexcept>
#include <thread>

#include "presets.h"

namespace moekit::tools {

namespace {
std::atomic<size_t> g_held{0};                     // bytes the live Buffers hold
std::atomic<double> g_limit{16.0 * (1ull << 30)};  // bytes they may hold
std::atomic<bool> g_huge_pages{false};             // --huge-pages
constexpr size_t kHugePage = size_t{2} << 20;
}  // namespace

void set_memory_limit_gib(double gib) { g_limit = gib * (1ull << 30); }

void set_huge_pages(bool on) { g_huge_pages = on; }
bool huge_pages() { return g_huge_pages; }

namespace {
std::string in_units(double bytes) {
  return bytes < (1ull << 30) ? fmt::format("{:.1f} MiB", bytes / (1ull << 20))
                              : fmt::format("{:.2f} GiB", bytes / (1ull << 30));
}
}  // namespace

void hold_bytes(size_t bytes) {
  if (static_cast<double>(g_held.load()) + static_cast<double>(bytes) > g_limit.load()) {
    throw std::runtime_error(
        fmt::format("a buffer of {} beside the {} held would pass --mem-limit-gib {:.4g} (raise "
                    "it, or lower --tokens)",
                    in_units(static_cast<double>(bytes)), in_units(static_cast<double>(g_held)),
                    g_limit.load() / (1ull << 30)));
  }
  g_held += bytes;
}
void release_bytes(size_t bytes) { g_held -= bytes; }
size_t held_bytes() { return g_held.load(); }

Buffer::Buffer(size_t bytes) : bytes_(bytes) {
  const size_t align = g_huge_pages && bytes >= kHugePage ? kHugePage : 64;
  const size_t rounded = (std::max<size_t>(bytes, 1) + align - 1) / align * align;
  if (rounded < bytes) hold_bytes(SIZE_MAX);  // refused, with the message
  hold_bytes(rounded);
  p_ = std::unique_ptr<void, Free>(std::aligned_alloc(align, rounded), Free(rounded));
  if (!p_) {
    release_bytes(rounded);
    throw std::bad_alloc();
  }
  // Advice only: where the kernel gives no huge pages, the buffer keeps small ones.
  if (align == kHugePage) madvise(p_.get(), rounded, MADV_HUGEPAGE);
}

void Buffer::Free::operator()(void* p) const {
  std::free(p);
  release_bytes(bytes);
}

namespace {
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
}  // namespace

void fill_uniform(void* p, DType t, int64_t n, uint64_t seed) {
  const uint64_t base = splitmix64(seed);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t r = splitmix64(base + static_cast<uint64_t>(i));
    const float u = static_cast<float>(r >> 40) * (2.0f / 16777216.0f) - 1.0f;  // [-1, 1)
    const bf16_bits b = float_to_bf16(u);
    if (t == DType::kBF16) {
      static_cast<bf16_bits*>(p)[i] = b;
    } else if (t == DType::kF16) {  // the same values (f16 holds every bf16 in [2^-14, 1))
      static_cast<_Float16*>(p)[i] = static_cast<_Float16>(bf16_to_float(b));
    } else {
      static_cast<float*>(p)[i] = bf16_to_float(b);
    }
  }
}

std::vector<int32_t> imbalanced_group_sizes(int64_t rows, int64_t groups, double imbalance,
                                            uint64_t seed) {
  std::vector<int32_t> sizes(groups, 0);
  if (groups == 0) return sizes;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<double> w(groups);
  double total = 0;
  for (auto& x : w) total += (x = 1.0 + imbalance * u(rng));
  int64_t assigned = 0;
  for (int64_t e = 0; e < groups; ++e) {
    sizes[e] = static_cast<int32_t>(std::floor(rows * w[e] / total));
    assigned += sizes[e];
  }
  for (int64_t e = 0; assigned < rows; e = (e + 1) % groups, ++assigned) ++sizes[e];
  return sizes;
}

std::vector<Timing> time_interleaved(int warmup, int reps,
                                     const std::vector<std::function<void()>>& fns) {
  using clock = std::chrono::steady_clock;
  for (int i = 0; i < warmup; ++i) {
    for (const auto& f : fns) f();
  }
  std::vector<std::vector<double>> ms(fns.size());
  for (int i = 0; i < std::max(reps, 1); ++i) {
    for (size_t j = 0; j < fns.size(); ++j) {
      const auto t0 = clock::now();
      fns[j]();
      ms[j].push_back(std::chrono::duration<double, std::milli>(clock::now() - t0).count());
    }
  }
  std::vector<Timing> out;
  for (auto& v : ms) out.push_back(summarize(std::move(v)));
  return out;
}

Timing summarize(std::vector<double> ms) {
  if (ms.empty()) return {};
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front()};
}

Progress::Progress(int total) : total_(total), tty_(isatty(STDERR_FILENO)) {}

void Progress::step(const std::string& label) {
  ++done_;
  const int w = static_cast<int>(std::to_string(total_).size());
  const std::string line = fmt::format("[{:>{}}/{}] {}", done_, w, total_, label);
  if (tty_) {
    fmt::print(stderr, "\r\033[K{}", line);
  } else {
    fmt::print(stderr, "{}\n", line);
  }
  std::fflush(stderr);
}

void Progress::finish() {
  if (tty_) fmt::print(stderr, "\r\033[K");
  std::fflush(stderr);
}

std::string ascii_bars(const std::vector<std::string>& labels, const std::vector<double>& values,
                       const std::string& unit, int width) {
  size_t label_w = 0;
  double vmax = 0;
  for (const auto& l : labels) label_w = std::max(label_w, l.size());
  for (double v : values) vmax = std::max(vmax, v);
  std::string out;
  for (size_t i = 0; i < labels.size(); ++i) {
    const int n = vmax > 0 ? static_cast<int>(std::lround(values[i] / vmax * width)) : 0;
    out += fmt::format("  {:>{}} | {:<{}} {:.3g} {}\n", labels[i], label_w, std::string(n, '#'),
                       width, values[i], unit);
  }
  return out;
}

DType parse_dtype(const std::string& s, const std::string& flag, bool allow_f16) {
  if (s == "bf16") return DType::kBF16;
  if (s == "f32") return DType::kF32;
  if (allow_f16 && s == "f16") return DType::kF16;
  throw CLI::ValidationError(flag, fmt::format("expected {}, got '{}'",
                                               allow_f16 ? "bf16, f16 or f32" : "bf16 or f32", s));
}

void check(const Status& s) {
  if (!s.ok()) throw std::runtime_error(s.message());
}

void parallel_copy(void* dst, const void* src, size_t bytes) {
#pragma omp parallel
  {
    const size_t n = static_cast<size_t>(omp_get_num_threads()),
                 i = static_cast<size_t>(omp_get_thread_num());
    const size_t begin = bytes * i / n, end = bytes * (i + 1) / n;
    std::memcpy(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin,
                end - begin);
  }
}

namespace {
volatile uint64_t read_sink;  // where parallel_read's sum goes, so that the reads stay
}  // namespace

void parallel_read(const void* src, size_t bytes, size_t streams) {
  streams = std::max<size_t>(streams, 1);
  uint64_t total = 0;
#pragma omp parallel reduction(+ : total)
  {
    const size_t n = static_cast<size_t>(omp_get_num_threads()),
                 i = static_cast<size_t>(omp_get_thread_num());
    const size_t words = bytes / sizeof(uint64_t);
    const size_t begin = words * i / n, end = words * (i + 1) / n;
    const auto* w = static_cast<const uint64_t*>(src);
    // The slice in `streams` parts read side by side, a line (8 words, independent sums so that
    // the loop vectorises) of each in turn.
    constexpr size_t kLine = 8;
    const size_t part = (end - begin) / (streams * kLine) * kLine;  // words of each part
    uint64_t sum[kLine] = {};
    for (size_t j = 0; j < part; j += kLine) {
      for (size_t s = 0; s < streams; ++s) {
        const uint64_t* p = w + begin + s * part + j;
        for (size_t u = 0; u < kLine; ++u) sum[u] += p[u];
      }
    }
    for (size_t j = begin + streams * part; j < end; ++j) sum[0] += w[j];
    for (uint64_t v : sum) total += v;
  }
  read_sink = total;
}

std::string machine_description() {
  std::string model = "unknown CPU";
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  }
  return fmt::format("{} ({} cores, {} OpenMP threads{})", model,
                     std::thread::hardware_concurrency(), omp_get_max_threads(),
                     huge_pages() ? ", buffers advised to take huge pages" : "");
}

std::string today_iso() {
  const std::time_t t = std::time(nullptr);
  char buf[16];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&t));
  return buf;
}

CLI::Validator integer_in(int64_t lo, int64_t hi, const std::string& what) {
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        int64_t v = 0;
        if (!CLI::detail::lexical_cast(s, v) || v < lo || v > hi) {
          return fmt::format("must be {}, got '{}'", what, s);
        }
        return {};
      },
      what);
}

CLI::Validator positive_number(const std::string& what) {
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(s, v) || !(v > 0) || !std::isfinite(v)) {
          return fmt::format("must be {}, got '{}'", what, s);
        }
        return {};
      },
      what);
}

void add_bench_options(CLI::App& cmd, BenchOptions& o, const std::string& dtype_help,
                       const std::string& mem_help) {
  cmd.add_option("--preset", o.preset, "Model preset: " + preset_names())->capture_default_str();
  // Tokens index i32 rows in the library.
  cmd.add_option("--tokens", o.tokens, "Token count(s), comma-separated (e.g. 1024,4096)")
      ->delimiter(',')
      ->check(integer_in(1, INT32_MAX, "a whole number of tokens in [1, 2^31 - 1]"))
      ->capture_default_str();
  cmd.add_option("--dtype", o.dtype, dtype_help)->capture_default_str();
  cmd.add_flag("--json", o.json, "Print a JSON array of the timed cases on stdout");
  cmd.add_option("--warmup", o.warmup, "Untimed runs per case")
      ->check(integer_in(0, 1000000, "a count of runs in [0, 10^6]"))
      ->capture_default_str();
  cmd.add_option("--reps", o.reps, "Timed runs per case (median reported)")
      ->check(integer_in(1, 1000000, "a count of runs in [1, 10^6]"))
      ->capture_default_str();
  cmd.add_option("--seed", o.seed, "Seed for the generated data")->capture_default_str();
  cmd.add_option("--mem-limit-gib", o.mem_limit_gib, mem_help)
      ->check(positive_number("a positive number of GiB"))
      ->capture_default_str();
  cmd.add_flag("--huge-pages", o.huge_pages,
               "Advise the host buffers of 2 MiB or more (weights, activations, the read rate's "
               "probe) to take 2 MiB transparent huge pages (madvise; the kernel's "
               "transparent_hugepage setting must be always or madvise)");
  cmd.parse_complete_callback([&o] {
    set_memory_limit_gib(o.mem_limit_gib);
    set_huge_pages(o.huge_pages);
  });
}

}  // namespace moekit::tools
