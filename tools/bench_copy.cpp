#include "bench_copy.h"

#include <fmt/format.h>

#include <algorithm>

namespace moekit::tools {

void time_against_copy(BenchDevice& dev, const std::vector<CopyCase>& cases, int64_t tokens,
                       const std::string& what, int warmup, int reps, uint64_t seed,
                       Progress& progress, std::vector<CopyRow>& rows) {
  size_t max_half = 0;
  for (const CopyCase& c : cases) max_half = std::max(max_half, static_cast<size_t>(c.bytes / 2));
  const Mem src = dev.alloc(2 * max_half), dst = dev.alloc(max_half);
  dev.fill(src.data(), DType::kBF16, static_cast<int64_t>(max_half), seed);
  for (const CopyCase& c : cases) {
    progress.step(
        fmt::format("{} {} {} beside a copy of {:.1f} MB", what, c.kernel, c.pass, c.bytes / 1e6));
    const size_t half = static_cast<size_t>(c.bytes / 2);
    std::vector<std::function<void()>> fns{c.run, [&] { dev.copy(dst.data(), src.data(), half); }};
    // The read reference as the floor's (FloorRead): timed as each of kFloorReadStreams streams
    // a thread, the faster kept (on an AMD EPYC one stream read 1.3-2x faster than four).
    if (dev.has_read()) {
      for (const size_t streams : kFloorReadStreams)
        fns.push_back([&, streams] { dev.read(src.data(), 2 * half, streams); });
    }
    const auto t = dev.time(warmup, reps, fns);
    rows.push_back({c.kernel, c.pass, tokens, 2.0 * half, t[0], t[1],
                    dev.has_read() ? faster_read(t, 2) : Timing{}});
  }
}

void print_copy_table(std::FILE* out, const BenchDevice& dev, const std::vector<CopyRow>& rows,
                      int warmup, int reps, const std::string& bytes_note) {
  fmt::print(out, "\n{:>6} {:>20} {:>4} {:>8} {:>8} {:>7} {:>8} {:>8} {:>8} {:>9} {:>8}\n",
             "tokens", "kernel", "pass", "MB", "ms", "GB/s", "copy ms", "copy GB/s", "vs copy",
             "read GB/s", "vs read");
  std::vector<std::string> labels;
  std::vector<double> ratios;
  for (const CopyRow& r : rows) {
    const double ratio = 100.0 * r.gbps() / r.copy_gbps();
    const bool read = r.read.median_ms > 0;
    fmt::print(
        out,
        "{:>6} {:>20} {:>4} {:>8.1f} {:>8.3f} {:>7.1f} {:>8.3f} {:>8.1f} {:>7.0f}% {:>9} {:>8}\n",
        r.tokens, r.kernel, r.pass, r.bytes / 1e6, r.t.median_ms, r.gbps(), r.copy.median_ms,
        r.copy_gbps(), ratio, read ? fmt::format("{:.1f}", r.read_gbps()) : "-",
        read ? fmt::format("{:.0f}%", 100.0 * r.gbps() / r.read_gbps()) : "-");
    labels.push_back(fmt::format("T={} {} {}", r.tokens, r.kernel, r.pass));
    ratios.push_back(ratio);
  }
  fmt::print(out,
             "\nms: median of {} runs after {} warm-up, each call alternating with {}. {}\n\nrate "
             "as a share of the copy's:\n{}",
             reps, warmup, dev.copy_description(), bytes_note, ascii_bars(labels, ratios, "%"));
}

nlohmann::json copy_row_json(const CopyRow& r) {
  nlohmann::json j{{"kernel", r.kernel},
                   {"pass", r.pass},
                   {"tokens", r.tokens},
                   {"bytes", r.bytes},
                   {"ms", r.t.median_ms},
                   {"min_ms", r.t.min_ms},
                   {"gbps", r.gbps()},
                   {"memcpy_ms", r.copy.median_ms},
                   {"memcpy_gbps", r.copy_gbps()},
                   {"ratio_to_memcpy", r.gbps() / r.copy_gbps()}};
  if (r.read.median_ms > 0) j.update({{"read_ms", r.read.median_ms}, {"read_gbps", r.read_gbps()}});
  return j;
}

}  // namespace moekit::tools
