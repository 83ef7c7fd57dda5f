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

#include <map>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <tuple>
#include <vector>

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

// Runs `fn(local index, first row, rows)` once per non-empty local group, the first of them
// starting at row `begin`, converting oneDNN exceptions into a Status.
//
// Threads: with at least kGroupsPerThread non-empty groups per thread, the groups are spread over
// the OpenMP threads and each oneDNN call runs single-threaded inside the parallel region (oneDNN
// does not nest); each thread then streams its own weights and no thread waits for another
// between groups. With fewer, larger groups, the groups run in order and oneDNN threads each
// one. (The two schedules side by side: bench/results/ragged_dot-cpu-2026-11-21/.)
template <typename Fn>
Status for_each_local_group(const char* op, const Groups& gr, int64_t begin, Fn&& fn) {
  constexpr int kGroupsPerThread = 4;
  struct Item {
    int64_t j, row, rows;
  };
  // Reused across calls: no allocation once it has grown to the largest E_loc seen. The worker
  // threads below must see this (the calling thread's) vector, hence the plain reference.
  thread_local std::vector<Item> reused;
  std::vector<Item>& items = reused;
  items.clear();
  int64_t row = begin;
  for (int64_t j = 0; j < gr.num_local; ++j) {
    const int64_t rows = gr.sizes[gr.offset + j];
    if (rows > 0) items.push_back({j, row, rows});
    row += rows;
  }
  const auto n = static_cast<int64_t>(items.size());
  if (n >= kGroupsPerThread * omp_get_max_threads()) {
    Status status;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      try {
        fn(items[i].j, items[i].row, items[i].rows);
      } catch (const dnnl::error& e) {
#pragma omp critical(moekit_onednn_error)
        if (status.ok()) status = onednn_error(op, e);
      }
    }
    return status;
  }
  try {
    for (const Item& it : items) fn(it.j, it.row, it.rows);
  } catch (const dnnl::error& e) {
    return onednn_error(op, e);
  }
  return {};
}

// Runs the cached primitive for `shape` once per non-empty local group; `bind(j, row, rows)`
// gives the group's actual shape and its operands {a, b, c}.
template <typename Bind>
Status run_per_group(const char* op, const Gemm& shape, const Groups& gr, int64_t begin,
                     Bind&& bind) {
  const Primitive* prim = nullptr;
  try {
    prim = &primitive_cache().get(shape);
  } catch (const dnnl::error& e) {
    return onednn_error(op, e);
  }
  return for_each_local_group(op, gr, begin, [&](int64_t j, int64_t row, int64_t rows) {
    const auto [actual, a, b, c] = bind(j, row, rows);
    execute(*prim, actual, a, b, c);
  });
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
  const size_t in_es = dtype_size(g.in_type), out_es = dtype_size(g.out_type);
  return run_per_group(
      "ragged_dot", shape, gr, local.begin, [&](int64_t j, int64_t row, int64_t rows) {
        Gemm actual = shape;
        actual.M = rows;  // [rows, kc] @ [kc, n] -> [rows, n]
        return std::tuple(actual, static_cast<const char*>(g.a) + row * g.lda * in_es,
                          static_cast<const char*>(g.b) + j * g.b_batch * in_es,
                          static_cast<char*>(g.c) + row * g.ldc * out_es);
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
  Gemm shape{g.in_type, g.out_type, g.p, kRuntime, g.q, 1, g.ldx, g.ldy, 1, g.ldc, g.accumulate};
  return run_per_group("ragged_dot_drhs", shape, gr, local_rows(gr).begin,
                       [&](int64_t j, int64_t row, int64_t rows) {
                         Gemm actual = shape;
                         actual.Kc = rows;  // [p, rows] @ [rows, q] -> [p, q]
                         return std::tuple(actual,
                                           static_cast<const char*>(g.x) + row * g.ldx * in_es,
                                           static_cast<const char*>(g.y) + row * g.ldy * in_es,
                                           static_cast<char*>(g.c) + j * g.c_batch * out_es);
                       });
}

}  // namespace moekit::detail
