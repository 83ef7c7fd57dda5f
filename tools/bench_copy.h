// Timing memory-bound kernels against a copy of the same bytes: each kernel call alternates,
// run by run, with a copy of the same number of bytes (half read, half written) and, on the CPU,
// a plain read of them (bench_device.h says how each device copies), so that the ratios are taken
// under the same machine state. The copy is the reference the issues set; the read is the ceiling
// of a kernel that mostly reads. Shared by the router and permute benches.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_common.h"
#include "bench_device.h"

namespace moekit::tools {

// One timed call and the nominal bytes it reads and writes.
struct CopyCase {
  std::string kernel, pass;
  double bytes;
  std::function<void()> run;
};

struct CopyRow {
  std::string kernel, pass;
  int64_t tokens;
  double bytes;
  Timing t, copy, read;  // read: zero where the device has none
  double gbps() const { return bytes / (t.median_ms * 1e6); }
  double copy_gbps() const { return bytes / (copy.median_ms * 1e6); }
  double read_gbps() const { return bytes / (read.median_ms * 1e6); }
};

// Times every case on `dev` beside a copy (and a read) of its bytes, stepping `progress` with
// `what` (e.g. the preset and token count) in the label; appends one row per case.
void time_against_copy(BenchDevice& dev, const std::vector<CopyCase>& cases, int64_t tokens,
                       const std::string& what, int warmup, int reps, uint64_t seed,
                       Progress& progress, std::vector<CopyRow>& rows);

// The table (ms, GB/s, the copy's and the read's, the ratios), the note on how it was taken, and a
// bar chart of the ratios. `bytes_note` says what the bytes of each case are.
void print_copy_table(std::FILE* out, const BenchDevice& dev, const std::vector<CopyRow>& rows,
                      int warmup, int reps, const std::string& bytes_note);

// The keys every JSON object of such a bench carries: kernel, pass, tokens, bytes, ms, min_ms,
// gbps, memcpy_ms, memcpy_gbps, ratio_to_memcpy; and read_ms, read_gbps where a read was timed.
nlohmann::json copy_row_json(const CopyRow& r);

}  // namespace moekit::tools
