// ragged_dot on oneDNN: each local group is one matmul call on a primitive whose group-dependent
// dimension (the rows M in the forward and input gradient, the contraction in the weight
// gradient) is a runtime dimension. One primitive therefore serves every group size and every
// call with the same K, n, layout and dtypes; it is created once and cached, so no primitive
// creation or weight packing sits in the per-call path.
//
// The runtime-dimension primitive was measured against one fixed-shape primitive per group size
// and against a dense matmul of the same FLOPs: bench/results/ragged_dot-cpu-2026-11-21/.
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <tuple>
#include <vector>

#include "check.h"
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

// The batch-invariant schedule: every call single-threaded (a threaded oneDNN matmul may split
// the contraction over the threads, so a row's bits would follow the thread count and the
// matrix's shape), spread over the threads; the row problem in blocks of at most
// kInvariantMaxRows rows and at least kInvariantMinRows (fewer are padded up to it). oneDNN's
// gemm:jit takes other paths below 16 rows (a gemv at one row; at 2-15 rows another order for
// f32 with a transposed B), so a row's bits then followed its block's size; from 16 rows up (to
// 700, on five shapes, when this was written) they do not. tests/cpp/test_ragged_dot.cpp
// (BatchInvariant) checks it on the machine that runs the tests, with blocks of every kind. The
// largest block holds a typical expert's rows in one call (blocks of 256 cost the qwen3 layer
// 6% of its speed: bench/results/invariant-cpu-2026-11-24).
constexpr int64_t kInvariantMinRows = 16;
constexpr int64_t kInvariantMaxRows = 512;

// This thread's buffer for a padded block, grown to at least `bytes`.
char* padded_block(size_t bytes) {
  thread_local std::vector<char> buffer;
  if (buffer.size() < bytes) buffer.resize(bytes);
  return buffer.data();
}

// Runs a block of the row problem with fewer than kInvariantMinRows rows as a block of
// kInvariantMinRows: its rows copied into a padded buffer with the same row strides (so that the
// same cached primitive runs), the rest zero, the product's first `rows` rows copied back.
void run_padded(const Primitive& prim, const Gemm& shape, const RowGroupedGemm& g, const char* a,
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
  actual.M = kInvariantMinRows;
  execute(prim, actual, pa, b, pc);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(c + r * c_row, pc + r * c_row, g.n * out_es);
}

const Primitive* cached(const char* op, const Gemm& shape, Status* status) {
  try {
    return &primitive_cache().get(shape);
  } catch (const dnnl::error& e) {
    *status = onednn_error(op, e);
    return nullptr;
  }
}

}  // namespace

Status row_grouped_gemm_onednn(const RowGroupedGemm& g) {
  const Groups& gr = g.groups;
  const RowRange local = local_rows(gr);
  if (!g.accumulate) {
    zero_rows(g.c, g.out_type, g.ldc, g.n, 0, local.begin);
    zero_rows(g.c, g.out_type, g.ldc, g.n, local.end, g.m);
  }
  if (g.n == 0 || local.end == local.begin) return {};
  if (g.kc == 0) {  // empty contraction: the product is 0
    if (!g.accumulate) zero_rows(g.c, g.out_type, g.ldc, g.n, local.begin, local.end);
    return {};
  }
  Gemm shape{g.in_type, g.out_type, kRuntime, g.kc,  g.n,         g.lda,
             1,         g.b_s0,     g.b_s1,   g.ldc, g.accumulate};
  const char* op = "ragged_dot";
  Status status;
  const Primitive* prim = cached(op, shape, &status);
  if (prim == nullptr) return status;
  const size_t in_es = dtype_size(g.in_type), out_es = dtype_size(g.out_type);
  // The padded block: kInvariantMinRows rows of A (lda elements apart) and of C (ldc apart).
  int64_t a_bytes = 0, c_bytes = 0;
  if (g.batch_invariant &&
      !(mul_fits(kInvariantMinRows * static_cast<int64_t>(in_es), g.lda, &a_bytes) &&
        mul_fits(kInvariantMinRows * static_cast<int64_t>(out_es), g.ldc, &c_bytes) &&
        a_bytes <= INT64_MAX - c_bytes)) {
    return Status::invalid_argument(op, "row strides", fmt::format("{}, {}", g.lda, g.ldc),
                                    "too large for the batch-invariant mode's padded block");
  }
  const std::vector<Item>& items =
      local_items(gr, local.begin, g.batch_invariant ? kInvariantMaxRows : 0);
  return run_items(op, items, g.batch_invariant || spread_groups(items), [&](const Item& it) {
    const char* a = static_cast<const char*>(g.a) + it.row * g.lda * in_es;
    const char* b = static_cast<const char*>(g.b) + it.j * g.b_batch * in_es;
    char* c = static_cast<char*>(g.c) + it.row * g.ldc * out_es;
    if (g.batch_invariant && it.rows < kInvariantMinRows) {
      run_padded(*prim, shape, g, a, b, c, it.rows, static_cast<size_t>(a_bytes),
                 static_cast<size_t>(c_bytes));
      return;
    }
    Gemm actual = shape;
    actual.M = it.rows;  // [rows, kc] @ [kc, n] -> [rows, n]
    execute(*prim, actual, a, b, c);
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
  // the router's: long, and often alone) computes its output rows in parts of kInvariantMaxRows,
  // each one single-threaded call, so that it still spreads over the threads. Whether and how a
  // group splits follows from its own rows and p alone, so the same rows give the same bits.
  constexpr int64_t kInvariantSplitRows = 2048;
  const int64_t part = std::min(g.p, kInvariantMaxRows);
  const int64_t parts = (g.p + part - 1) / part;
  Gemm part_shape = whole, last_shape = whole;
  part_shape.M = part, last_shape.M = g.p - (parts - 1) * part;
  const char* op = "ragged_dot_drhs";
  Status status;
  const Primitive* prims[3] = {};  // whole, a part, the last part
  for (int i = 0; i < (g.batch_invariant ? 3 : 1); ++i) {
    prims[i] = cached(op, i == 0 ? whole : i == 1 ? part_shape : last_shape, &status);
    if (prims[i] == nullptr) return status;
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
    execute(*prims[which], actual, static_cast<const char*>(g.x) + (it.row * g.ldx + first) * in_es,
            static_cast<const char*>(g.y) + it.row * g.ldy * in_es,
            static_cast<char*>(g.c) + (it.j * g.c_batch + first * g.ldc) * out_es);
  });
}

}  // namespace moekit::detail
