// moekit bench ragged_dot: times the forward, input gradient and weight gradient of ragged_dot
// on a preset's real shapes (m = tokens * k routed rows, E groups; K = H, n = F, or with --matmul
// the layer's gate|up (K = H, n = 2F) or down (K = F, n = H) matmul), each beside a
// dense matmul of the same FLOPs and operand layouts run in the same process (oneDNN, or cuBLAS
// with --device cuda), and with --ep-shards S one shard's call (E/S local groups) beside the full
// call. On the CPU each call is also set against its floor (roofline.h): the weight bytes it must
// read at the read rate, or its FLOPs at the dense rate, both measured in the same run; the
// weights are cold by default (--cache), as in a model whose layers do not fit the caches.
#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <span>
#include <stdexcept>
#include <utility>

#include "bench_common.h"
#include "bench_device.h"
#include "benches.h"
#include "moekit/ragged_dot.h"
#include "presets.h"
#include "roofline.h"

namespace moekit::tools {
namespace {

struct RaggedDotBenchOptions : BenchOptions {
  std::string out_dtype;  // empty: the input dtype
  int shards = 1;
  int shard = -1;  // which shard's call to time; -1: the middle one
  double imbalance = 0.25;
  bool invariant = false;      // also time the batch-invariant mode (CPU)
  std::string cache = "cold";  // cold: cycle through copies of the weights (CPU); warm: one copy
  std::vector<std::string> passes{"fwd", "dlhs", "drhs"};
  std::string impl = "auto";    // RaggedDotOptions::impl of the timed calls
  std::string baseline;         // also time the full call with this impl, in the same loop
  std::string matmul = "ffn";   // the shape: ffn (K = H, n = F), up (K = H, n = 2F), down (F, H)
  bool rhs_transposed = false;  // the weights stored [E, n, K] (RaggedDotOptions::rhs_transposed)
  bool rhs_packed = false;  // the forward on packed weights (pack_ragged_rhs; --baseline unpacked)
};

// The contraction K and output width n of --matmul's shape on a preset.
struct MatmulShape {
  int64_t K, n;
};
MatmulShape matmul_shape(const Preset& p, const std::string& matmul) {
  if (matmul == "up") return {p.H, 2 * p.F};
  if (matmul == "down") return {p.F, p.H};
  return {p.H, p.F};
}

// --impl and --baseline's choices, in RaggedDotImpl's order, by the library's impl_name.
constexpr RaggedDotImpl kImpls[] = {
    RaggedDotImpl::kAuto,
    RaggedDotImpl::kOneDnn,
    RaggedDotImpl::kReference,
    RaggedDotImpl::kCudaSm90,
    RaggedDotImpl::kCudaSm80,
    RaggedDotImpl::kCudaPortable,
    RaggedDotImpl::kCpuStream,
    RaggedDotImpl::kCudaSm90Pingpong,
    RaggedDotImpl::kCudaSm90Cooperative256,
    RaggedDotImpl::kCudaSm90Pingpong64x256,
    RaggedDotImpl::kCudaSm90Pingpong64x256Runs,
    RaggedDotImpl::kCudaSm90Cooperative256Runs,
};

RaggedDotImpl parse_impl(const std::string& name) {
  for (const RaggedDotImpl impl : kImpls) {
    if (name == impl_name(impl)) return impl;
  }
  return RaggedDotImpl::kAuto;  // CLI11 checked the name
}

std::vector<std::string> impl_names() {
  std::vector<std::string> names;
  for (const RaggedDotImpl impl : kImpls) names.emplace_back(impl_name(impl));
  return names;
}

constexpr int64_t kPeakRows = 4096;  // the dense matmul that measures the dense rate

// One timed case: a pass (fwd, dlhs, drhs) of the full call or of one shard, beside the dense
// matmul of all m rows run in the same loop.
struct RaggedDotRow {
  std::string pass;
  int64_t tokens, m, E, e_loc, offset, local_rows;
  int shards;
  Timing t, dense;
  Timing invariant;                          // with --invariant: the same call in the mode
  Timing baseline;                           // with --baseline: the full call with that impl
  RaggedDotImpl ran = RaggedDotImpl::kAuto;  // the implementation the timed calls ran
  double flops, dense_flops, full_ms;        // full_ms: the full call's time, for shard rows
  std::string dense_impl;
  // The floor (CPU): the distinct local groups' weight bytes, the rates measured beside it, the
  // copies of the weights cycled (1: warm, or the weights already larger than the caches).
  double weight_bytes = 0;
  Roofline roof;
  int64_t copies = 1;
  double floor_ms() const { return roof.floor_ms(weight_bytes, flops); }
  bool has_floor() const { return roof.read_gbps > 0; }
};

// The problem of one token count: m routed rows over E groups (a stated subset of the preset's
// experts when the buffers would not fit in mem_limit_gib), with their sizes.
struct RaggedDotProblem {
  int64_t tokens, m, E, K, n;
  std::vector<int32_t> sizes;
};

using Options = RaggedDotBenchOptions;
using Row = RaggedDotRow;

// The elements of measure_rates' three buffers (the dense matmuls' A, B and C, kPeakRows rows)
// for contraction K and output width n: A [M, max(K, n)] and B [M, n] ([M, K] for the weights
// [E, n, K]) of the input dtype, C of the output's, large enough for every pass's product.
struct RatesBuffers {
  int64_t a, b, c;
};
RatesBuffers rates_buffers(int64_t K, int64_t n, bool rhs_transposed) {
  const int64_t M = kPeakRows, wide = std::max(K, n);
  return {M * wide, M * (rhs_transposed ? K : n), std::max(M * wide, K * n)};
}

// A pass's dense matmul of m rows with the pass's operand layouts: C [M, N] = op(A) [M, Kd] x
// op(B) [Kd, N], A and B the pass's operands a_is and b_is (kRhs: one weight matrix, [K, n], or
// [n, K] when transposed).
enum class Operand { kLhs, kDOut, kRhs };
struct DenseLayout {
  int64_t M, Kd, N;
  bool a_transposed, b_transposed;
  Operand a_is, b_is;
};
DenseLayout dense_layout(const std::string& pass, bool rhs_transposed, int64_t m, int64_t K,
                         int64_t n) {
  const bool t = rhs_transposed;
  using enum Operand;
  if (pass == "fwd") return {m, K, n, false, t, kLhs, kRhs};     // lhs @ rhs
  if (pass == "dlhs") return {m, n, K, false, !t, kDOut, kRhs};  // d_out @ rhs^T
  // The weight gradient in the weights' layout: lhs^T @ d_out, or its transpose d_out^T @ lhs.
  return t ? DenseLayout{n, m, K, true, false, kDOut, kLhs}
           : DenseLayout{K, m, n, true, false, kLhs, kDOut};
}

// `floor_rates`: the buffers of the floor's rates are held beside the call's (CPU: a read probe
// and the dense matmuls of rates_buffers).
RaggedDotProblem ragged_dot_problem(const Preset& p, int64_t tokens, DType in, DType out,
                                    const RaggedDotBenchOptions& o, bool floor_rates,
                                    std::FILE* text) {
  // Fit the weights (and their gradient) in memory: otherwise a stated subset of experts, with
  // the same rows per expert.
  const size_t in_es = dtype_size(in), out_es = dtype_size(out);
  const auto [K, n] = matmul_shape(p, o.matmul);
  int64_t E = p.E, m = tokens * p.k;
  const bool drhs = std::find(o.passes.begin(), o.passes.end(), "drhs") != o.passes.end();
  const RatesBuffers rb = rates_buffers(K, n, o.rhs_transposed);
  const double rates_bytes =
      floor_rates ? static_cast<double>(read_probe_bytes() + in_es * (rb.a + rb.b) + out_es * rb.c)
                  : 0.0;
  auto bytes = [&](int64_t e, int64_t mm) {
    return rates_bytes +
           static_cast<double>(in_es * (mm * K + (1 + o.rhs_packed) * e * K * n + mm * n) +
                               out_es * (mm * n + mm * K + (drhs ? e * K * n : 0)));
  };
  const double limit = o.mem_limit_gib * (1ull << 30);
  if (bytes(E, m) > limit) {
    int64_t e = E;
    while (e > o.shards && bytes(e, m * e / E) > limit) e -= o.shards;
    if (bytes(e, m * e / E) > limit || m * e / E < 1) {
      throw std::runtime_error(fmt::format(
          "{} of {} experts ({} rows) need {:.2f} GiB, over --mem-limit-gib {}: raise it, or lower "
          "--tokens",
          e, E, m * e / E, bytes(e, m * e / E) / (1ull << 30), o.mem_limit_gib));
    }
    fmt::print(text,
               "note: {} experts need {:.1f} GiB (> --mem-limit-gib {}); running {} of them "
               "with the same rows per expert ({} rows instead of {})\n",
               E, bytes(E, m) / (1ull << 30), o.mem_limit_gib, e, m * e / E, m);
    m = m * e / E;
    E = e;
  }
  return {tokens, m, E, K, n, imbalanced_group_sizes(m, E, o.imbalance, o.seed)};
}

RaggedDotRow full_row(const std::string& pass, const RaggedDotProblem& pr,
                      const std::string& dense_impl) {
  RaggedDotRow r{.pass = pass,
                 .tokens = pr.tokens,
                 .m = pr.m,
                 .E = pr.E,
                 .e_loc = pr.E,
                 .offset = 0,
                 .local_rows = pr.m,
                 .shards = 1,
                 .t = {},
                 .dense = {},
                 .invariant = {},
                 .baseline = {},
                 .ran = RaggedDotImpl::kAuto,
                 .flops = 0,
                 .dense_flops = 0,
                 .full_ms = 0,
                 .dense_impl = dense_impl,
                 .weight_bytes = 0,
                 .roof = {},
                 .copies = 1};
  r.flops = r.dense_flops = 2.0 * pr.m * pr.K * pr.n;
  return r;
}

// One pass timed on dev in one interleaved loop: call(E, 0, {}) (the full call), dense() beside
// it, with o.shards > 1 one shard's call (E/shards local groups from group_offset
// shard*E/shards), with o.invariant each of those calls again in the batch-invariant mode, and
// the floor's read (may be null), whose rate becomes the rows' read rate; `label` names the step
// in the progress line. Appends the full call's row and the shard's.
void time_pass(BenchDevice& dev, const RaggedDotBenchOptions& o, const RaggedDotProblem& pr,
               int shard, RaggedDotRow full,
               const std::function<Status(int64_t, int32_t, const RaggedDotOptions&)>& call,
               const std::function<void()>& dense, const FloorRead* read, const std::string& label,
               Progress& progress, std::vector<RaggedDotRow>& rows) {
  RaggedDotOptions plain, invariant;
  plain.impl = parse_impl(o.impl);
  plain.rhs_transposed = invariant.rhs_transposed = o.rhs_transposed;
  plain.rhs_packed = invariant.rhs_packed = o.rhs_packed;
  plain.ran = &full.ran;
  invariant.batch_invariant = true;
  std::vector<std::function<void()>> fns{[&] { check(call(pr.E, 0, plain)); }, dense};
  if (o.invariant) fns.push_back([&] { check(call(pr.E, 0, invariant)); });
  RaggedDotRow one = full;
  RaggedDotOptions shard_plain = plain;
  shard_plain.ran = &one.ran;
  if (o.shards > 1) {  // one shard's call: E/S local groups from its group_offset
    one.shards = o.shards;
    one.e_loc = pr.E / o.shards;
    one.offset = shard * one.e_loc;
    one.local_rows =
        ragged_dot_flops(pr.sizes, static_cast<int32_t>(one.offset), one.e_loc, 1, 1) / 2;
    one.flops = 2.0 * one.local_rows * pr.K * pr.n;
    int64_t touched = 0, touched_here = 0;  // groups with rows: all of them, the shard's
    for (int64_t e = 0; e < pr.E; ++e) {
      touched += pr.sizes[e] > 0;
      touched_here += pr.sizes[e] > 0 && e >= one.offset && e < one.offset + one.e_loc;
    }
    one.weight_bytes = full.pass == "drhs" ? full.weight_bytes * one.e_loc / pr.E
                       : touched > 0       ? full.weight_bytes * touched_here / touched
                                           : 0;
    const auto offset = static_cast<int32_t>(one.offset);
    fns.push_back([&, offset] { check(call(one.e_loc, offset, shard_plain)); });
    if (o.invariant) fns.push_back([&, offset] { check(call(one.e_loc, offset, invariant)); });
  }
  progress.step(fmt::format("{}{}{}, interleaved", label,
                            o.shards > 1 ? fmt::format(", shard {}/{}", shard, o.shards) : "",
                            o.invariant ? ", invariant mode" : ""));
  const size_t read_at = fns.size();
  if (read) read->add_to(dev, fns);
  const size_t base_at = fns.size();
  RaggedDotOptions base;
  base.impl = parse_impl(o.baseline);
  base.rhs_transposed = o.rhs_transposed;
  if (!o.baseline.empty()) fns.push_back([&] { check(call(pr.E, 0, base)); });
  const std::vector<Timing> t = dev.time(o.warmup, o.reps, fns);
  const size_t per_call = o.invariant ? 2 : 1;  // timings per call: the default, the mode
  if (read) {                                   // the read rate of these very runs
    full.roof.read_gbps = read->gbps(t, read_at);
    one.roof.read_gbps = full.roof.read_gbps;
  }
  full.t = t[0], full.dense = t[1], full.full_ms = t[0].median_ms;
  if (o.invariant) full.invariant = t[2];
  if (!o.baseline.empty()) full.baseline = t[base_at];
  rows.push_back(full);
  if (o.shards > 1) {
    const size_t at = 1 + per_call;
    one.t = t[at], one.dense = t[1], one.full_ms = t[0].median_ms;
    if (o.invariant) one.invariant = t[at + 1];
    rows.push_back(one);
  }
}

// The weights of a call: `copies` copies of [E, K, n] cycled call by call, copy c starting
// c * span experts past the first (span: one past the last group with rows, so that the copies'
// touched experts never share memory while the untouched ones may).
struct Weights {
  Mem mem;
  int64_t copies = 1, span = 0, touched = 0;
  size_t expert_bytes = 0;
  int64_t next = 0;
  void* data() { return mem.bytes_data() + ((next++) % copies) * span * expert_bytes; }
};

Weights make_weights(BenchDevice& dev, const Options& o, const RaggedDotProblem& pr, DType in,
                     std::FILE* text) {
  Weights w;
  w.expert_bytes = static_cast<size_t>(pr.K * pr.n) * dtype_size(in);
  for (int64_t e = 0; e < pr.E; ++e) {
    if (pr.sizes[e] > 0) ++w.touched, w.span = e + 1;
  }
  if (o.cache == "cold" && dev.has_read()) {
    w.copies = cold_copies(static_cast<double>(w.touched * w.expert_bytes));
    // Within the memory limit, beside what is held already (the read probe), leaving a GiB for
    // everything else.
    // (With --rhs-packed each copy is there twice, packed and not.)
    const double room = (o.mem_limit_gib - 1) * (1ull << 30) - static_cast<double>(held_bytes()) -
                        static_cast<double>((1 + o.rhs_packed) * pr.E * w.expert_bytes) -
                        4.0 * pr.m * (pr.K + pr.n);
    const auto fit = static_cast<int64_t>(
                         room / std::max<double>(1, (1 + o.rhs_packed) * w.span * w.expert_bytes)) +
                     1;
    if (fit < w.copies) {
      fmt::print(text, "note: T={}: {} copies of the weights would pass --mem-limit-gib; {}\n",
                 pr.tokens, w.copies, fit > 1 ? fmt::format("{} copies", fit) : "warm");
      w.copies = std::max<int64_t>(1, fit);
    }
  }
  const int64_t experts = pr.E + (w.copies - 1) * w.span;
  w.mem = dev.alloc(experts * w.expert_bytes);
  dev.fill(w.mem.data(), in, experts * pr.K * pr.n, o.seed + 2);
  return w;
}

// With --rhs-packed, `w`'s copies packed (pack_ragged_rhs), expert by expert at the same places:
// for the forward, or (`transpose`) their transposes for the input gradient.
Weights pack_weights(BenchDevice& dev, const RaggedDotProblem& pr, DType in, const Weights& w,
                     bool transpose) {
  Weights p = w;
  p.next = 0;
  const PackedRhsShape s =
      transpose ? packed_rhs_shape(1, pr.n, pr.K, in) : packed_rhs_shape(1, pr.K, pr.n, in);
  p.expert_bytes = static_cast<size_t>(s.dims[1] * s.dims[2]) * dtype_size(in);
  const int64_t experts = pr.E + (w.copies - 1) * w.span;
  p.mem = dev.alloc(experts * p.expert_bytes);
  RaggedDotOptions read_as;
  read_as.rhs_transposed = transpose;  // [E, K, n] read as [E, n' = K, K' = n]
  check(pack_ragged_rhs(ConstTensorView(w.mem.bytes_data(), in, {experts, pr.K, pr.n}),
                        TensorView(p.mem.bytes_data(), in, {experts, s.dims[1], s.dims[2]}),
                        read_as));
  return p;
}

// The read rate and the dense rate of each pass's layout, measured together (CPU).
struct Rates {
  double read_gbps = 0;
  std::map<std::string, double> dense_tflops;
};

Rates measure_rates(BenchDevice& dev, const Options& o, const RaggedDotProblem& pr, DType in,
                    DType out, const FloorRead& read, const void* weights) {
  Rates r;
  const int64_t M = kPeakRows, K = pr.K, n = pr.n;
  const size_t in_es = dtype_size(in), out_es = dtype_size(out);
  const RatesBuffers rb = rates_buffers(K, n, o.rhs_transposed);
  Mem a = dev.alloc(rb.a * in_es), b = dev.alloc(rb.b * in_es), c = dev.alloc(rb.c * out_es);
  dev.fill(a.data(), in, rb.a, o.seed + 4);
  dev.fill(b.data(), in, rb.b, o.seed + 5);
  std::vector<std::unique_ptr<DenseRef>> dense;
  std::vector<std::function<void()>> fns;
  read.add_to(dev, fns);
  const size_t dense_at = fns.size();
  for (const std::string& pass : o.passes) {
    const DenseLayout l = dense_layout(pass, o.rhs_transposed, M, K, n);
    dense.push_back(dev.dense(in, out, l.M, l.Kd, l.N, l.a_transposed, l.b_transposed));
    const void* b_data = l.b_is == Operand::kRhs ? weights : b.data();
    fns.push_back([&, d = dense.back().get(), b_data] { d->run(a.data(), b_data, c.data()); });
  }
  const std::vector<Timing> t = dev.time(o.warmup, o.reps, fns);
  r.read_gbps = read.gbps(t, 0);
  for (size_t i = 0; i < o.passes.size(); ++i)
    r.dense_tflops[o.passes[i]] = 2.0 * M * K * n / (t[dense_at + i].median_ms * 1e9);
  return r;
}

// Each pass on `dev` beside a dense matmul of all m rows with the same FLOPs and operand layouts
// (oneDNN on the CPU, cuBLAS on a GPU; bench_device.h), and with --ep-shards one shard's call;
// on the CPU first the rates of the floor.
void time_on(BenchDevice& dev, const Options& o, const Preset& p, DType in, DType out, int shard,
             std::FILE* text, Progress& progress, std::vector<Row>& rows) {
  const size_t in_es = dtype_size(in), out_es = dtype_size(out);
  const bool drhs = std::find(o.passes.begin(), o.passes.end(), "drhs") != o.passes.end();
  Mem probe;  // the read rate's probe (FloorRead), allocated once the first problem is known to fit

  for (int64_t T : o.tokens) {
    const RaggedDotProblem pr = ragged_dot_problem(p, T, in, out, o, dev.has_read(), text);
    if (dev.has_read() && probe.data() == nullptr) {
      probe = dev.alloc(read_probe_bytes());
      dev.fill(probe.data(), DType::kF32, static_cast<int64_t>(probe.bytes() / 4), o.seed + 6);
    }
    const int64_t m = pr.m, E = pr.E, K = pr.K, n = pr.n;
    Weights rhs = make_weights(dev, o, pr, in, text);
    const bool dlhs_only = o.passes == std::vector<std::string>{"dlhs"};
    Weights packed = o.rhs_packed ? pack_weights(dev, pr, in, rhs, dlhs_only) : Weights{};
    Mem lhs = dev.alloc(m * K * in_es), d_out = dev.alloc(m * n * in_es);
    Mem y = dev.alloc(m * n * out_es), d_lhs = dev.alloc(m * K * out_es),
        d_rhs = dev.alloc(drhs ? E * K * n * out_es : 1);
    dev.fill(lhs.data(), in, m * K, o.seed + 1);
    dev.fill(d_out.data(), in, m * n, o.seed + 3);
    Rates rates;
    const FloorRead floor = floor_read({o.rhs_packed ? &packed.mem : &rhs.mem}, probe);
    if (dev.has_read()) {
      progress.step(fmt::format("{} T={}: read rate, dense rate ({} rows)", p.name, T, kPeakRows));
      rates = measure_rates(dev, o, pr, in, out, floor, rhs.mem.data());
    }
    // The group sizes where the calls read them (device memory on a GPU).
    Mem sizes = dev.alloc(pr.sizes.size() * sizeof(int32_t));
    dev.upload(sizes.data(), pr.sizes.data(), pr.sizes.size() * sizeof(int32_t));
    const Exec exec = dev.exec(dev.alloc(ragged_dot_workspace_size(dev.device(), E)));
    const std::span<const int32_t> sizes_v(static_cast<const int32_t*>(sizes.data()),
                                           pr.sizes.size());
    const ConstTensorView lhs_v(lhs.data(), in, {m, K}), d_out_v(d_out.data(), in, {m, n});
    const TensorView y_v(y.data(), out, {m, n}), d_lhs_v(d_lhs.data(), out, {m, K});

    for (const std::string& pass : o.passes) {
      // One call of this pass with e_loc local groups starting at `offset`, on the next copy of
      // the weights.
      auto call = [&](int64_t e_loc, int32_t offset, const RaggedDotOptions& opt) {
        const RaggedDotGroups groups{sizes_v, offset};
        // A weight matrix's two dimensions as stored: [K, n], or [n, K] transposed.
        const int64_t rows = o.rhs_transposed ? n : K, cols = o.rhs_transposed ? K : n;
        if (pass == "drhs") {
          return ragged_dot_drhs(lhs_v, d_out_v, groups,
                                 TensorView(d_rhs.data(), out, {e_loc, rows, cols}), opt, exec);
        }
        if (opt.rhs_packed) {
          const PackedRhsShape s =
              pass == "fwd" ? packed_rhs_shape(e_loc, K, n, in) : packed_rhs_shape(e_loc, n, K, in);
          const ConstTensorView w(packed.data(), in, {e_loc, s.dims[1], s.dims[2]});
          if (pass == "fwd") return ragged_dot(lhs_v, w, groups, y_v, opt, exec);
          return ragged_dot_dlhs(d_out_v, w, groups, d_lhs_v, opt, exec);
        }
        const ConstTensorView w(rhs.data(), in, {e_loc, rows, cols});
        if (pass == "fwd") return ragged_dot(lhs_v, w, groups, y_v, opt, exec);
        return ragged_dot_dlhs(d_out_v, w, groups, d_lhs_v, opt, exec);
      };
      // The dense matmul of all m rows with the pass's operand layouts (one weight matrix).
      const DenseLayout l = dense_layout(pass, o.rhs_transposed, m, K, n);
      const std::unique_ptr<DenseRef> dense =
          dev.dense(in, out, l.M, l.Kd, l.N, l.a_transposed, l.b_transposed);
      const auto operand = [&](Operand is) -> const void* {
        return is == Operand::kLhs    ? lhs.data()
               : is == Operand::kDOut ? d_out.data()
                                      : rhs.mem.data();
      };
      const void *da = operand(l.a_is), *db = operand(l.b_is);
      void* dc = pass == "fwd" ? y.data() : pass == "dlhs" ? d_lhs.data() : d_rhs.data();
      RaggedDotRow full = full_row(pass, pr, dense->impl());
      // The floor: the weights of the groups with rows; the weight gradient writes every local
      // group's (an empty group's as zeros).
      full.weight_bytes = pass == "drhs"
                              ? static_cast<double>(E * rhs.expert_bytes) * out_es / in_es
                              : static_cast<double>(rhs.touched * rhs.expert_bytes);
      full.roof = {rates.read_gbps, rates.dense_tflops[pass]};
      full.copies = pass == "drhs" ? 1 : rhs.copies;
      // Cold, the read rate is taken in the same loop as the calls (FloorRead's probe read then
      // evicts the weights it read); warm, beside the dense rate before, so that it does not.
      const bool read = o.cache == "cold" && dev.has_read();
      time_pass(
          dev, o, pr, shard, full, call, [&] { dense->run(da, db, dc); }, read ? &floor : nullptr,
          fmt::format("{} T={} {}: ragged_dot, dense ({}){}", p.name, T, pass, dense->impl(),
                      full.copies > 1 ? fmt::format(", {} weight copies", full.copies) : ""),
          progress, rows);
    }
  }
}

int run(const Options& o) {
  const Preset* p = find_preset(o.preset);
  if (!p)
    throw CLI::ValidationError("--preset",
                               "unknown preset '" + o.preset + "'; known: " + preset_names());
  const bool cuda = o.device == "cuda";  // f16 runs on GPUs only
  const DType in = parse_dtype(o.dtype, "--dtype", cuda);
  const DType out = o.out_dtype.empty() ? in : parse_dtype(o.out_dtype, "--out-dtype", cuda);
  if (o.shards < 1 || p->E % o.shards != 0) {
    throw CLI::ValidationError("--ep-shards", fmt::format("{} must divide E = {}", o.shards, p->E));
  }
  if (o.rhs_packed && (cuda || (in != DType::kBF16 && in != DType::kF32) || o.rhs_transposed ||
                       (o.passes != std::vector<std::string>{"fwd"} &&
                        o.passes != std::vector<std::string>{"dlhs"}))) {
    throw CLI::ValidationError("--rhs-packed",
                               "packed weights serve the CPU's bf16 and f32 forward and input "
                               "gradient, one at a time: --passes fwd or dlhs, bf16 or f32, no "
                               "--rhs-transposed, --device cpu");
  }
  if (o.invariant && cuda) {
    throw CLI::ValidationError("--invariant", "the batch-invariant mode runs on the CPU only");
  }
  const int shard = o.shard < 0 ? o.shards / 2 : o.shard;
  if (shard >= o.shards) throw CLI::ValidationError("--shard", "must be < --ep-shards");

  std::FILE* text = o.json ? stderr : stdout;  // --json keeps stdout for the JSON array
  const MatmulShape shape = matmul_shape(*p, o.matmul);
  fmt::print(text,
             "moekit bench ragged_dot  preset={} (H={} F={} E={} k={})  matmul={} (K={} n={})  "
             "rhs={}  dtype={} out={}  device={}  impl={}  cache={}  {}\n",
             p->name, p->H, p->F, p->E, p->k, o.matmul, shape.K, shape.n,
             o.rhs_packed       ? "packed (pack_ragged_rhs)"
             : o.rhs_transposed ? "[E, n, K]"
                                : "[E, K, n]",
             dtype_name(in), dtype_name(out), o.device, o.impl, o.cache, today_iso());
  fmt::print(text,
             "groups: expert e gets rows in proportion to 1 + {}*u_e, u_e ~ U(-1,1), seed {}\n",
             o.imbalance, o.seed);
  std::vector<Row> rows;
  const std::unique_ptr<BenchDevice> dev = make_bench_device(o.device);
  Progress progress(static_cast<int>(o.tokens.size() * (o.passes.size() + dev->has_read())));
  time_on(*dev, o, *p, in, out, shard, text, progress, rows);
  progress.finish();
  const std::string machine = dev->description();
  fmt::print(text, "machine: {}\n", machine);

  // The table.
  const bool floor = !rows.empty() && rows.front().has_floor();
  fmt::print(
      text, "\n{:>6} {:>5} {:>7} {:>8} {:>9} {:>8} {:>9} {:>8} {:>9} {:>8}{}{}  {}\n", "tokens",
      "pass", "shard", "rows", "ms", "TFLOP/s", "dense ms", "dense TF", "vs dense", "of full",
      floor ? fmt::format(" {:>8} {:>9} {:>7} {:>8}", "MB read", "floor ms", "bound", "of floor")
            : "",
      fmt::format("{}{}", o.invariant ? fmt::format(" {:>9} {:>9}", "inv ms", "inv rate") : "",
                  o.baseline.empty() ? "" : fmt::format(" {:>9} {:>8}", "base ms", "speedup")),
      "ran");
  for (const Row& r : rows) {
    const bool base = !o.baseline.empty() && r.shards == 1;
    const double tf = r.flops / (r.t.median_ms * 1e9);
    const double dense_tf = r.dense_flops / (r.dense.median_ms * 1e9);
    const std::string shard_s =
        r.shards == 1 ? "all" : fmt::format("{}/{}", r.offset / r.e_loc, r.shards);
    fmt::print(
        text,
        "{:>6} {:>5} {:>7} {:>8} {:>9.2f} {:>8.3f} {:>9.2f} {:>8.3f} {:>8.1f}% {:>8}{}{}  {}\n",
        r.tokens, r.pass, shard_s, r.local_rows, r.t.median_ms, tf, r.dense.median_ms, dense_tf,
        100.0 * tf / dense_tf,
        r.shards == 1 ? std::string("") : fmt::format("{:.1f}%", 100.0 * r.t.median_ms / r.full_ms),
        floor ? fmt::format(" {:>8.1f} {:>9.2f} {:>7} {:>7.1f}%", r.weight_bytes / 1e6,
                            r.floor_ms(), r.roof.bound(r.weight_bytes, r.flops),
                            100.0 * r.floor_ms() / r.t.median_ms)
              : "",
        fmt::format("{}{}",
                    o.invariant ? fmt::format(" {:>9.2f} {:>8.1f}%", r.invariant.median_ms,
                                              100.0 * r.t.median_ms / r.invariant.median_ms)
                                : "",
                    base ? fmt::format(" {:>9.2f} {:>7.2f}x", r.baseline.median_ms,
                                       r.baseline.median_ms / r.t.median_ms)
                         : ""),
        impl_name(r.ran));
  }
  fmt::print(
      text,
      "\nms: median of {} runs after {} warm-up, ragged_dot, dense and shard runs "
      "alternating; TFLOP/s = 2*rows*K*n / time; dense: one "
      "matmul of all m rows ({}); shard k/S: E/S local groups from group_offset "
      "k*E/S, 'of full' its time over the full call's; ran: the implementation that ran it "
      "(RaggedDotOptions::ran).{}\n",
      o.reps, o.warmup, rows.empty() ? "" : rows.front().dense_impl,
      fmt::format("{}{}",
                  o.invariant ? " inv: the same call in the batch-invariant mode, in the same "
                                "loop; 'inv rate' its throughput as a share of the default mode's."
                              : "",
                  o.baseline.empty()
                      ? ""
                      : fmt::format(" base: the full call with --impl {}, in the same "
                                    "loop; speedup = its time over the timed call's.",
                                    o.baseline)));
  if (floor) {
    fmt::print(
        text,
        "floor = max(MB read / read rate, FLOPs / dense rate): MB read = the weights of the "
        "groups with rows (for drhs, every group's gradient written); read rate: the faster of "
        "two parallel reads of the weights' own buffers (every copy; of a {} MiB probe where they "
        "hold less), one stream "
        "a thread and four side by side, timed in the same loop as the pass (cold) or before it "
        "(warm); dense rate: a {}-row dense matmul of the "
        "pass's layout, timed before each token count's passes. Weights {}.\n",
        read_probe_bytes() >> 20, kPeakRows,
        o.cache == "cold" ? "cold: the forward and input gradient cycle through copies of "
                            "them where one call's would fit 4x in the last-level cache"
                          : "warm: one copy, cached where it fits");
    fmt::print(text, "\n{:>6} {:>10} {:>8} {:>7}\n", "tokens", "read GB/s", "dense TF", "copies");
    for (const Row& r : rows) {
      if (r.pass != o.passes.front() || r.shards != 1) continue;
      fmt::print(text, "{:>6} {:>10.1f} {:>8.3f} {:>7}\n", r.tokens, r.roof.read_gbps,
                 r.roof.dense_tflops, r.copies);
    }
  }

  if (o.tokens.size() > 1) {  // how time scales with tokens, or the share of the floor
    for (const std::string& pass : o.passes) {
      std::vector<std::string> labels;
      std::vector<double> values;
      for (const Row& r : rows) {
        if (r.pass != pass || r.shards != 1) continue;
        labels.push_back(fmt::format("T={} {:.2f} ms", r.tokens, r.t.median_ms));
        values.push_back(floor ? 100.0 * r.floor_ms() / r.t.median_ms
                               : 1e3 * r.t.median_ms / r.tokens);
      }
      if (floor) {
        fmt::print(text, "\n{}: share of the floor (100% = at the floor)\n{}", pass,
                   ascii_bars(labels, values, "%"));
      } else {
        fmt::print(text, "\n{}: time per token (flat bars = linear in tokens)\n{}", pass,
                   ascii_bars(labels, values, "us/token"));
      }
    }
  }

  if (o.json) {
    nlohmann::json arr = nlohmann::json::array();
    for (const Row& r : rows) {
      nlohmann::json j{{"op", "ragged_dot"},
                       {"pass", r.pass},
                       {"dtype", std::string(dtype_name(in))},
                       {"out_dtype", std::string(dtype_name(out))},
                       {"preset", p->name},
                       {"tokens", r.tokens},
                       {"shards", r.shards},
                       {"group_offset", r.offset},
                       {"E", r.E},
                       {"E_loc", r.e_loc},
                       {"m", r.m},
                       {"local_rows", r.local_rows},
                       {"matmul", o.matmul},
                       {"K", shape.K},
                       {"n", shape.n},
                       {"rhs_transposed", o.rhs_transposed},
                       {"rhs_packed", o.rhs_packed},
                       {"ms", r.t.median_ms},
                       {"min_ms", r.t.min_ms},
                       {"tflops", r.flops / (r.t.median_ms * 1e9)},
                       {"dense_ms", r.dense.median_ms},
                       {"dense_tflops", r.dense_flops / (r.dense.median_ms * 1e9)},
                       {"dense_impl", r.dense_impl},
                       {"impl", o.impl},
                       {"ran", impl_name(r.ran)},
                       {"device", o.device},
                       {"machine", machine}};
      j["ratio_to_dense"] = j["tflops"].get<double>() / j["dense_tflops"].get<double>();
      if (r.shards > 1) j["ratio_to_full"] = r.t.median_ms / r.full_ms;
      if (r.has_floor()) {
        j.update(floor_json(r.roof, r.weight_bytes, r.flops, r.t.median_ms, o.cache, r.copies));
      }
      if (!o.baseline.empty() && r.shards == 1) {
        j["baseline_impl"] = o.baseline;
        j["baseline_ms"] = r.baseline.median_ms;
        j["speedup_over_baseline"] = r.baseline.median_ms / r.t.median_ms;
      }
      if (o.invariant) {
        j["invariant_ms"] = r.invariant.median_ms;
        j["invariant_rate"] = r.t.median_ms / r.invariant.median_ms;
      }
      arr.push_back(j);
    }
    fmt::print("{}\n", arr.dump(1));
  }
  return 0;
}

}  // namespace

void register_bench_ragged_dot(CLI::App& bench) {
  auto opts = std::make_shared<RaggedDotBenchOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "ragged_dot", "Time ragged_dot (forward, input and weight gradient) against dense oneDNN");
  opts->preset = "qwen3-30b-a3b";
  opts->tokens = {4096};
  opts->dtype = "bf16";
  opts->warmup = 2;
  opts->reps = 5;
  opts->mem_limit_gib = 12;
  add_bench_options(*cmd, *opts, "Input dtype: bf16 | f32 (| f16 with --device cuda)",
                    "Run a subset of experts when buffers would exceed this");
  add_device_option(*cmd, opts->device);
  cmd->add_option("--out-dtype", opts->out_dtype,
                  "Output dtype: f32 or the input dtype (default: --dtype)");
  cmd->add_option("--ep-shards", opts->shards, "Also time one of S expert-parallel shards")
      ->check(integer_in(1, 1 << 20, "a count of shards in [1, 2^20] that divides E"))
      ->capture_default_str();
  cmd->add_option("--shard", opts->shard, "Which shard to time (default: S/2)")
      ->check(integer_in(0, 1 << 20, "a shard index in [0, --ep-shards)"));
  cmd->add_flag("--invariant", opts->invariant,
                "Also time each call in the batch-invariant mode, in the same loop (CPU)");
  cmd->add_option("--cache", opts->cache,
                  "cold: cycle through copies of the weights where one call's would stay cached, "
                  "as a model's layers do (CPU); warm: one copy")
      ->check(CLI::IsMember({"cold", "warm"}))
      ->capture_default_str();
  add_cache_size_option(*cmd);
  cmd->add_option("--passes", opts->passes, "Passes to time, comma-separated: fwd, dlhs, drhs")
      ->delimiter(',')
      ->check(CLI::IsMember({"fwd", "dlhs", "drhs"}))
      ->capture_default_str();
  cmd->add_option("--impl", opts->impl,
                  "Implementation of the timed calls (RaggedDotOptions::impl): auto picks by "
                  "shape; onednn, stream, reference (CPU); sm90, sm90-pingpong, "
                  "sm90-pingpong-64x256, sm90-cooperative-256, sm90-pingpong-64x256-runs, "
                  "sm90-cooperative-256-runs, sm80, portable (CUDA)")
      ->check(CLI::IsMember(impl_names()))
      ->capture_default_str();
  cmd->add_option("--baseline", opts->baseline,
                  "Also time the full call with this implementation, in the same loop")
      ->check(CLI::IsMember(impl_names()));
  cmd->add_option("--matmul", opts->matmul,
                  "The shape: ffn (K = H, n = F: the gate's or the up projection's alone), up (K = "
                  "H, n = 2F: the layer's gate|up matmul), down (K = F, n = H: its down matmul)")
      ->check(CLI::IsMember({"ffn", "up", "down"}))
      ->capture_default_str();
  cmd->add_flag("--rhs-transposed", opts->rhs_transposed,
                "The weights stored [E, n, K] (RaggedDotOptions::rhs_transposed), each pass and "
                "its dense matmul in that layout");
  cmd->add_flag(
      "--rhs-packed", opts->rhs_packed,
      "The forward on packed weights (pack_ragged_rhs, RaggedDotOptions::rhs_packed; "
      "--passes fwd, or dlhs on their transposes packed; bf16 or f32, CPU); --baseline runs on the "
      "same weights unpacked");
  cmd->add_option("--imbalance", opts->imbalance, "Group size spread, see the header line")
      ->check(CLI::Range(0.0, 0.99))
      ->capture_default_str();
  cmd->callback([opts] { run(*opts); });
}

}  // namespace moekit::tools
