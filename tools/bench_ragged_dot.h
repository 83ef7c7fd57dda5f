// moekit bench ragged_dot: its options and result rows, shared by the CPU timing
// (bench_ragged_dot.cpp) and the CUDA timing (bench_ragged_dot_cuda.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "bench_common.h"
#include "moekit/dtype.h"
#include "moekit/ragged_dot.h"
#include "moekit/status.h"
#include "presets.h"

namespace moekit::tools {

struct RaggedDotBenchOptions : BenchOptions {
  std::string out_dtype;  // empty: the input dtype
  int shards = 1;
  int shard = -1;  // which shard's call to time; -1: the middle one
  double imbalance = 0.25;
  bool invariant = false;  // also time the batch-invariant mode (CPU)
};

// One timed case: a pass (fwd, dlhs, drhs) of the full call or of one shard, beside the dense
// matmul of all m rows run in the same loop.
struct RaggedDotRow {
  std::string pass;
  int64_t tokens, m, E, e_loc, offset, local_rows;
  int shards;
  Timing t, dense;
  Timing invariant;                    // with --invariant: the same call in the mode
  double flops, dense_flops, full_ms;  // full_ms: the full call's time, for shard rows
  std::string dense_impl;
};

// The problem of one token count: m routed rows over E groups (a stated subset of the preset's
// experts when the buffers would not fit in mem_limit_gib), with their sizes.
struct RaggedDotProblem {
  int64_t tokens, m, E, K, n;
  std::vector<int32_t> sizes;
};
RaggedDotProblem ragged_dot_problem(const Preset& p, int64_t tokens, DType in, DType out,
                                    const RaggedDotBenchOptions& o, std::FILE* text);

// The full call's row of a pass, with its useful FLOPs.
RaggedDotRow full_row(const std::string& pass, const RaggedDotProblem& pr,
                      const std::string& dense_impl);

// One pass timed in one interleaved loop: call(E, 0, {}) (the full call), dense() beside it, with
// o.shards > 1 one shard's call (E/shards local groups from group_offset shard*E/shards), and with
// o.invariant each of those calls again in the batch-invariant mode. `time`
// runs the loop (wall clock on the CPU, CUDA events on the GPU); `label` names the step in the
// progress line. Appends the full call's row and the shard's.
using TimeLoop = std::function<std::vector<Timing>(const std::vector<std::function<void()>>&)>;
void time_pass(const RaggedDotBenchOptions& o, const RaggedDotProblem& pr, int shard,
               RaggedDotRow full,
               const std::function<Status(int64_t, int32_t, const RaggedDotOptions&)>& call,
               const std::function<void()>& dense, const TimeLoop& time, const std::string& label,
               Progress& progress, std::vector<RaggedDotRow>& rows);

// Times the three passes on the GPU with CUDA events, each beside a cuBLAS matmul of the same
// FLOPs; appends to rows and returns a description of the device. Throws when built without
// CUDA or when no device is present.
std::string time_ragged_dot_cuda(const RaggedDotBenchOptions& o, const Preset& p, DType in,
                                 DType out, int shard, std::FILE* text, Progress& progress,
                                 std::vector<RaggedDotRow>& rows);

}  // namespace moekit::tools
