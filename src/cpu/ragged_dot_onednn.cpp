// ragged_dot on oneDNN: each local group is one matmul call on a primitive whose group-dependent
// dimension (the rows M in the forward and input gradient, the contraction in the weight
// gradient) is a runtime dimension. One primitive therefore serves every group size and every
// call with the same K, n, layout and dtypes; it is created once and cached, so no primitive
// creation or weight packing sits in the per-call path.
//
// The runtime-dimension primitive was measured against one fixed-shape primitive per group size
// and against a dense matmul of the same FLOPs: bench/results/ragged_dot-cpu-2026-11-21/.
//
// Where oneDNN has no bf16 matmul (it needs AVX-512: a CPU with AVX2 alone has none), a bf16
// call converts its operands to f32 as it runs them and uses the f32 matmul: the same result,
// since every bf16 is an f32 and products and sums are f32 either way (native_bf16, Run).
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <tuple>
#include <vector>

#include "check.h"
#include "cpu/convert.h"
#include "cpu/grouped_gemm.h"

namespace moekit::detail {
namespace {

using dnnl::memory;
constexpr dnnl_dim_t kRuntime = DNNL_RUNTIME_DIM_VAL;

memory::data_type to_dnnl(DType t) {
  return t == DType::kF32 ? memory::data_type::f32 : memory::data_type::bf16;
}

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// C[M, N] (+)= A[M, Kc] @ B[Kc, N], each operand 2-D with explicit strides. One of M and Kc may be
// kRuntime in a cache key; at execution all dimensions are known.
struct Gemm {
  DType in_type, out_type;
  dnnl_dim_t M, Kc, N;
  dnnl_dim_t sa0, sa1, sb0, sb1, sc0;  // C is row-major: its column stride is 1
  bool accumulate;

  auto key() const {
    return std::tuple(in_type, out_type, M, Kc, N, sa0, sa1, sb0, sb1, sc0, accumulate);
  }
  memory::desc a_desc() const { return {{M, Kc}, to_dnnl(in_type), {sa0, sa1}}; }
  memory::desc b_desc() const { return {{Kc, N}, to_dnnl(in_type), {sb0, sb1}}; }
  memory::desc c_desc() const { return {{M, N}, to_dnnl(out_type), {sc0, 1}}; }
};

// A primitive and the size of the scratch memory it needs. The scratchpad is user-managed: with
// oneDNN's default (library-managed) scratchpad, two threads running the same primitive at once
// shared its f32 accumulation buffer and corrupted bf16 outputs (caught by the tests with 2
// threads).
struct Primitive {
  dnnl::matmul prim;
  memory::desc scratchpad;
};

class PrimitiveCache {
 public:
  // The primitive for `shape` (whose runtime dimensions are kRuntime), created on first use.
  const Primitive& get(const Gemm& shape) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(shape.key());
    if (it != cache_.end()) return it->second;
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (shape.accumulate) {
      dnnl::post_ops ops;
      ops.append_sum(1.f);
      attr.set_post_ops(ops);
    }
    dnnl::matmul::primitive_desc pd(
        dnnl::matmul::desc(shape.a_desc(), shape.b_desc(), shape.c_desc()), attr, cpu_engine());
    return cache_.emplace(shape.key(), Primitive{dnnl::matmul(pd), pd.scratchpad_desc()})
        .first->second;
  }

 private:
  std::mutex mu_;
  std::map<decltype(std::declval<Gemm>().key()), Primitive> cache_;
};

PrimitiveCache& primitive_cache() {
  static PrimitiveCache cache;
  return cache;
}

// This thread's scratch memory, grown to at least `bytes` (kept for the thread's lifetime, so
// repeated calls allocate nothing).
void* thread_scratch(size_t bytes) {
  thread_local std::vector<std::byte> buffer;
  if (buffer.size() < bytes) buffer.resize(bytes);
  return buffer.data();
}

void execute(const Primitive& p, const Gemm& actual, const void* a, const void* b, void* c) {
  thread_local dnnl::stream stream(cpu_engine());
  memory ma(actual.a_desc(), cpu_engine(), const_cast<void*>(a));
  memory mb(actual.b_desc(), cpu_engine(), const_cast<void*>(b));
  memory mc(actual.c_desc(), cpu_engine(), c);
  memory scratch(p.scratchpad, cpu_engine(), thread_scratch(p.scratchpad.get_size()));
  p.prim.execute(stream, {{DNNL_ARG_SRC, ma},
                          {DNNL_ARG_WEIGHTS, mb},
                          {DNNL_ARG_DST, mc},
                          {DNNL_ARG_SCRATCHPAD, scratch}});
  stream.wait();
}

Status onednn_error(const char* op, const dnnl::error& e) {
  return Status::internal(
      op, fmt::format("oneDNN failed: {} (status {})", e.what(), static_cast<int>(e.status)));
}

// One matmul of a call: local group j's rows [row, row + rows), all of them or a block; for the
// weight gradient in the batch-invariant mode, `part` says which of the output's rows.
struct Item {
  int64_t j, row, rows;
  int64_t part = 0;
};

// The matmuls of a call: one per non-empty local group, the first group starting at row `begin`;
// with max_rows > 0, one per block of at most max_rows rows of a group. Reused across calls (no
// allocation once grown to the largest call seen); valid until this thread's next call.
const std::vector<Item>& local_items(const Groups& gr, int64_t begin, int64_t max_rows) {
  thread_local std::vector<Item> items;
  items.clear();
  int64_t row = begin;
  for (int64_t j = 0; j < gr.num_local; ++j) {
    const int64_t rows = gr.sizes[gr.offset + j];
    const int64_t block = max_rows > 0 ? max_rows : rows;
    for (int64_t r = 0; r < rows; r += block)
      items.push_back({j, row + r, std::min(block, rows - r)});
    row += rows;
  }
  return items;
}

// Runs fn(item) for every item, converting oneDNN exceptions into a Status. Spread: the items
// are spread over the OpenMP threads and each oneDNN call runs single-threaded inside the
// parallel region (oneDNN does not nest); otherwise they run in order and oneDNN threads each.
template <typename Fn>
Status run_items(const char* op, const std::vector<Item>& items, bool spread, Fn&& fn) {
  const auto n = static_cast<int64_t>(items.size());
  if (spread) {
    Status status;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      try {
        fn(items[i]);
      } catch (const dnnl::error& e) {
#pragma omp critical(moekit_onednn_error)
        if (status.ok()) status = onednn_error(op, e);
      }
    }
    return status;
  }
  try {
    for (const Item& it : items) fn(it);
  } catch (const dnnl::error& e) {
    return onednn_error(op, e);
  }
  return {};
}

// The default schedule: with at least kGroupsPerThread non-empty groups per thread, one group per
// call spread over the threads (each thread then streams its own weights and no thread waits for
// another between groups); with fewer, larger groups, the groups in order, oneDNN threading each.
// (The two side by side: bench/results/ragged_dot-cpu-2026-11-21/.)
bool spread_groups(const std::vector<Item>& items) {
  constexpr int kGroupsPerThread = 4;
  return static_cast<int64_t>(items.size()) >= kGroupsPerThread * omp_get_max_threads();
}

// Whether oneDNN has a bf16 matmul on this CPU: probed once.
bool native_bf16() {
  static const bool has = [] {
    try {
      const memory::desc a({1, 16}, memory::data_type::bf16, {16, 1}),
          b({16, 16}, memory::data_type::bf16, {16, 1}),
          c({1, 16}, memory::data_type::f32, {16, 1});
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), cpu_engine());
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return has;
}

// How a shape runs: its primitive, and for a bf16 shape without a native bf16 matmul the f32
// shape that computes it, with each operand converted into a per-thread buffer of the same
// orientation, packed (strides that never name the runtime dimension), and a bf16 output
// converted back.
struct Run {
  const Primitive* prim = nullptr;
  Gemm shape;    // the call's own, strides of its operands in memory
  Gemm compute;  // the primitive's: shape itself, or the f32 stand-in
  bool emulated = false;
  uint64_t call = 0;  // which ragged_dot call: converted weights are reused within one only
};

Gemm f32_stand_in(const Gemm& g) {
  Gemm f = g;
  f.in_type = DType::kF32;
  f.out_type = DType::kF32;
  // A [M, Kc] packed along its fixed dimension: row-major for the row problem (M the runtime
  // one), column-major for the contraction's X^T (Kc the runtime one).
  if (g.M == kRuntime) {
    f.sa0 = g.Kc, f.sa1 = 1;
  } else {
    f.sa0 = 1, f.sa1 = g.M;
  }
  // B [Kc, N] in its source's orientation where Kc is fixed (the input gradient's transposed
  // weights: column-major, so that widen reads and writes it along the same lines), else
  // row-major (the contraction's B, Y, is row-major).
  if (g.sb0 == 1 && g.sb1 != 1 && g.Kc != kRuntime) {
    f.sb0 = 1, f.sb1 = g.Kc;
  } else {
    f.sb0 = g.N, f.sb1 = 1;
  }
  if (g.out_type != DType::kF32) f.sc0 = g.N;
  return f;
}

Run prepare(const char* op, const Gemm& shape, Status* status) {
  static std::atomic<uint64_t> calls{0};
  Run r;
  r.call = ++calls;
  r.shape = shape;
  r.emulated = shape.in_type == DType::kBF16 && !native_bf16();
  r.compute = r.emulated ? f32_stand_in(shape) : shape;
  try {
    r.prim = &primitive_cache().get(r.compute);
  } catch (const dnnl::error& e) {
    *status = onednn_error(op, e);
  }
  return r;
}

// dst [rows, cols] f32 (d0, d1) = src [rows, cols] bf16 (s0, s1), along the lines of both: down
// the columns where both are column-major (the weight gradient's X^T, the input gradient's
// transposed weights: f32_stand_in keeps each operand's orientation), else along the rows. (Row by
// row, each element of a column-major side was a cache line of its own: the input gradient ran
// 2.3x slower, bench/results/ragged_dot_small-cpu-2026-11-27/onednn-stand-in.md.) Threaded when
// not inside a parallel region already.
void widen(const bf16_bits* src, int64_t s0, int64_t s1, int64_t rows, int64_t cols, float* dst,
           int64_t d0, int64_t d1) {
  const bool parallel = !omp_in_parallel() && rows * cols >= (1 << 16);
  const bool by_columns = s0 == 1 && d0 == 1;
  if (by_columns || (s1 == 1 && d1 == 1)) {  // contiguous lines on both sides
    const int64_t lines = by_columns ? cols : rows, length = by_columns ? rows : cols;
    const int64_t src_step = by_columns ? s1 : s0, dst_step = by_columns ? d1 : d0;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t i = 0; i < lines; ++i)
      load_row_as_float(src + i * src_step, DType::kBF16, length, dst + i * dst_step);
    return;
  }
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[r * d0 + c * d1] = bf16_to_float(src[r * s0 + c * s1]);
  }
}

// This thread's f32 buffers for the emulated operands: A, B and C. B remembers what it holds, so
// that the blocks of one group convert their weights once per call (not across calls: the
// weights may change in place between them).
struct F32Buffers {
  std::vector<float> a, b, c;
  uint64_t b_call = 0;
  const void* b_source = nullptr;
};
F32Buffers& f32_buffers() {
  thread_local F32Buffers buffers;
  return buffers;
}

// Runs `actual` (run.shape with its runtime dimension filled in) on a, b, c.
void execute(const Run& run, const Gemm& actual, const void* a, const void* b, void* c) {
  if (!run.emulated) return execute(*run.prim, actual, a, b, c);
  F32Buffers& buf = f32_buffers();
  Gemm f = run.compute;
  f.M = actual.M, f.Kc = actual.Kc;
  buf.a.resize(static_cast<size_t>(actual.M * actual.Kc));
  widen(static_cast<const bf16_bits*>(a), actual.sa0, actual.sa1, actual.M, actual.Kc, buf.a.data(),
        f.sa0, f.sa1);
  // Within a call, a B pointer names one matrix of one shape (a group's weights, or the rows
  // of a contraction, which differ per group).
  if (buf.b_call != run.call || buf.b_source != b) {
    buf.b.resize(static_cast<size_t>(actual.Kc * actual.N));
    widen(static_cast<const bf16_bits*>(b), actual.sb0, actual.sb1, actual.Kc, actual.N,
          buf.b.data(), f.sb0, f.sb1);
    buf.b_call = run.call, buf.b_source = b;
  }
  if (actual.out_type == DType::kF32) return execute(*run.prim, f, buf.a.data(), buf.b.data(), c);
  // A bf16 output: computed in f32 (from its old values when accumulating), rounded once.
  buf.c.resize(static_cast<size_t>(actual.M * actual.N));
  auto* out = static_cast<bf16_bits*>(c);
  if (actual.accumulate) widen(out, actual.sc0, 1, actual.M, actual.N, buf.c.data(), actual.N, 1);
  execute(*run.prim, f, buf.a.data(), buf.b.data(), buf.c.data());
#pragma omp parallel for schedule(static) if (!omp_in_parallel() && \
                                              actual.M * actual.N >= (1 << 16))
  for (int64_t r = 0; r < actual.M; ++r) {
    for (int64_t j = 0; j < actual.N; ++j)
      out[r * actual.sc0 + j] = float_to_bf16(buf.c[r * actual.N + j]);
  }
}

// The batch-invariant schedule: every call single-threaded (a threaded oneDNN matmul may split
// the contraction over the threads, so a row's bits would follow the thread count), spread over
// the threads, and every call of the row problem exactly kInvariantRows rows: a group's rows in
// blocks of that many, the last padded up to it. oneDNN's gemm chooses its kernels, their tiles
// and its blocking by the shape, M included: a row's bits followed the size of the call it was in
// (on an AVX2 CPU, for calls past a few hundred rows, and for the last 1-3 rows of a tile of 6;
// on an AVX-512 one below 16 rows), while inside calls of one fixed size every row got the same
// bits wherever it sat (measured with every row equal, for several layer shapes, calls of 48 to
// 960 rows). So one size for every call, a multiple of the row tiles seen (6 with AVX2, 16 with
// AVX-512): 48, small enough that a group's padding stays a small part of its rows.
// tests/cpp/test_ragged_dot.cpp (BatchInvariant) checks it on the machine that runs the tests.
constexpr int64_t kInvariantRows = 48;

// This thread's buffer for a padded block, grown to at least `bytes`.
char* padded_block(size_t bytes) {
  thread_local std::vector<char> buffer;
  if (buffer.size() < bytes) buffer.resize(bytes);
  return buffer.data();
}

// Runs a block of the row problem with fewer than kInvariantRows rows as a block of
// kInvariantRows: its rows copied into a padded buffer with the same row strides (so that the
// same cached primitive runs), the rest zero, the product's first `rows` rows copied back.
void run_padded(const Run& run, const Gemm& shape, const RowGroupedGemm& g, const char* a,
                const char* b, char* c, int64_t rows, size_t a_bytes, size_t c_bytes) {
  const size_t in_es = dtype_size(g.in_type), out_es = dtype_size(g.out_type);
  const size_t a_row = static_cast<size_t>(g.lda) * in_es,
               c_row = static_cast<size_t>(g.ldc) * out_es;
  char* pa = padded_block(a_bytes + c_bytes);
  char* pc = pa + a_bytes;
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(pa + r * a_row, a + r * a_row, g.kc * in_es);
    if (g.accumulate) std::memcpy(pc + r * c_row, c + r * c_row, g.n * out_es);
  }
  // The padding rows: zero (their products are dropped; zero keeps them finite and defined).
  std::memset(pa + rows * a_row, 0, a_bytes - rows * a_row);
  if (g.accumulate) std::memset(pc + rows * c_row, 0, c_bytes - rows * c_row);
  Gemm actual = shape;
  actual.M = kInvariantRows;
  execute(run, actual, pa, b, pc);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(c + r * c_row, pc + r * c_row, g.n * out_es);
}

}  // namespace

bool onednn_runs_amx() {
  static const bool amx = dnnl::get_effective_cpu_isa() == dnnl::cpu_isa::avx512_core_amx;
  return amx;
}

Status row_grouped_gemm_onednn(const RowGroupedGemm& g) {
  const Groups& gr = g.groups;
  const RowRange local = local_rows(gr);
  if (!row_edges_done(g)) return {};
  Gemm shape{g.in_type, g.out_type, kRuntime, g.kc,  g.n,         g.lda,
             1,         g.b_s0,     g.b_s1,   g.ldc, g.accumulate};
  const char* op = "ragged_dot";
  Status status;
  const Run run = prepare(op, shape, &status);
  if (run.prim == nullptr) return status;
  const size_t in_es = dtype_size(g.in_type), out_es = dtype_size(g.out_type);
  // The padded block: kInvariantRows rows of A (lda elements apart) and of C (ldc apart).
  int64_t a_bytes = 0, c_bytes = 0;
  if (g.batch_invariant &&
      !(mul_fits(kInvariantRows * static_cast<int64_t>(in_es), g.lda, &a_bytes) &&
        mul_fits(kInvariantRows * static_cast<int64_t>(out_es), g.ldc, &c_bytes) &&
        a_bytes <= INT64_MAX - c_bytes)) {
    return Status::invalid_argument(op, "row strides", fmt::format("{}, {}", g.lda, g.ldc),
                                    "too large for the batch-invariant mode's padded block");
  }
  const std::vector<Item>& items =
      local_items(gr, local.begin, g.batch_invariant ? kInvariantRows : 0);
  return run_items(op, items, g.batch_invariant || spread_groups(items), [&](const Item& it) {
    const char* a = static_cast<const char*>(g.a) + it.row * g.lda * in_es;
    const char* b = static_cast<const char*>(g.b) + it.j * g.b_batch * in_es;
    char* c = static_cast<char*>(g.c) + it.row * g.ldc * out_es;
    if (g.batch_invariant && it.rows < kInvariantRows) {
      run_padded(run, shape, g, a, b, c, it.rows, static_cast<size_t>(a_bytes),
                 static_cast<size_t>(c_bytes));
      return;
    }
    Gemm actual = shape;
    actual.M = it.rows;  // [rows, kc] @ [kc, n] -> [rows, n]
    execute(run, actual, a, b, c);
  });
}

Status contraction_grouped_gemm_onednn(const ContractionGroupedGemm& g) {
  const Groups& gr = g.groups;
  const size_t in_es = dtype_size(g.in_type), out_es = dtype_size(g.out_type);
  if (g.p == 0 || g.q == 0) return {};
  if (!g.accumulate) {  // empty groups get an exact 0 (non-empty ones are overwritten below)
    for (int64_t j = 0; j < gr.num_local; ++j) {
      if (gr.sizes[gr.offset + j] == 0) {
        zero_rows(static_cast<char*>(g.c) + j * g.c_batch * out_es, g.out_type, g.ldc, g.q, 0, g.p);
      }
    }
  }
  // A = X^T: [p, Kc] with strides (1, ldx); B = Y: [Kc, q] with strides (ldy, 1).
  Gemm whole{g.in_type, g.out_type, g.p, kRuntime, g.q, 1, g.ldx, g.ldy, 1, g.ldc, g.accumulate};
  // In the batch-invariant mode a group of at least kInvariantSplitRows rows (a shared expert's,
  // the router's: long, and often alone) computes its output rows in parts of kInvariantPartRows,
  // each one single-threaded call, so that it still spreads over the threads. Whether and how a
  // group splits follows from its own rows and p alone, so the same rows give the same bits.
  constexpr int64_t kInvariantSplitRows = 2048, kInvariantPartRows = 512;
  const int64_t part = std::min(g.p, kInvariantPartRows);
  const int64_t parts = (g.p + part - 1) / part;
  Gemm part_shape = whole, last_shape = whole;
  part_shape.M = part, last_shape.M = g.p - (parts - 1) * part;
  const char* op = "ragged_dot_drhs";
  Status status;
  Run runs[3];  // whole, a part, the last part
  for (int i = 0; i < (g.batch_invariant ? 3 : 1); ++i) {
    runs[i] = prepare(op, i == 0 ? whole : i == 1 ? part_shape : last_shape, &status);
    if (runs[i].prim == nullptr) return status;
  }
  const std::vector<Item>* groups = &local_items(gr, local_rows(gr).begin, 0);
  if (g.batch_invariant && parts > 1) {  // a long group's items: one per part
    thread_local std::vector<Item> split;
    split.clear();
    for (const Item& it : *groups) {
      if (it.rows < kInvariantSplitRows) {
        split.push_back(it);
      } else {
        for (int64_t i = 0; i < parts; ++i) split.push_back({it.j, it.row, it.rows, i + 1});
      }
    }
    groups = &split;
  }
  const std::vector<Item>& items = *groups;
  return run_items(op, items, g.batch_invariant || spread_groups(items), [&](const Item& it) {
    // it.part: 0 the whole output, i + 1 its rows [i * part, (i + 1) * part).
    const int64_t first = it.part == 0 ? 0 : (it.part - 1) * part;
    const int which = it.part == 0 ? 0 : it.part < parts ? 1 : 2;
    Gemm actual = which == 0 ? whole : which == 1 ? part_shape : last_shape;
    actual.Kc = it.rows;  // [M, rows] @ [rows, q] -> [M, q]
    execute(runs[which], actual, static_cast<const char*>(g.x) + (it.row * g.ldx + first) * in_es,
            static_cast<const char*>(g.y) + it.row * g.ldy * in_es,
            static_cast<char*>(g.c) + (it.j * g.c_batch + first * g.ldc) * out_es);
  });
}

}  // namespace moekit::detail
