// ragged_dot's weight gradient where every local group holds few rows (kCpuStream; kAuto picks it
// by contraction_stream_picks): C_j [p, q] (+)= X_j^T Y_j, each output row i the sum over the
// group's rows r of X[r][i] * Y[r], in that order, on f32 FMA. Few rows make the call mostly a
// write of C: oneDNN's matmul per group with a contraction of 1-16 rows ran 1.4-4.2x slower than
// these sums in the same loop, at 20-64% of the floor (every local group's gradient at the read
// rate) on qwen3-30b-a3b bf16 (bench/results/ragged_dot_drhs_outer-cpu-2026-12-01/).
//
// Work: items of kItemRows output rows of one group, in order, split over the threads in
// contiguous runs (each thread writes its part of C front to back). An item takes its X rows as
// f32 ([rows][kItemRows]) and, once for each group a thread meets, Y's rows as f32 ([rows][q]);
// it walks C's columns in blocks of kBlockCols (Y's block in L1) and, in each, its rows two at a
// time against kTileVecs vectors of columns: 8 sums in registers, each a chain of `rows` FMAs.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/ragged_dot_outer.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Must come after foreach_target.h.
#include <hwy/highway.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/grouped_gemm.h"
#include "cpu/lanes-inl.h"
#include "cpu/stream.h"

HWY_BEFORE_NAMESPACE();
namespace moekit::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
namespace {

constexpr int64_t kItemRows = 64;    // output rows an item
constexpr int64_t kBlockCols = 256;  // C's columns a block
constexpr int kTileRows = 2;         // output rows a tile
constexpr int kTileVecs = 4;         // vectors of columns a tile

// Output rows [i, i + I) of an item, columns [c, c + V * N): x the item's X as f32 (a row r at
// x + r * kItemRows, from output row i), y Y's rows as f32 (q apart, from column c), c_row C's
// row i at column c (ldc apart).
template <int I, int V, bool kBf16Out, bool kStream>
HWY_INLINE void Tile(const float* x, const float* y, int64_t q, int64_t rows, void* c_row,
                     int64_t ldc, bool accumulate) {
  const lanes::D d;
  constexpr size_t N = hn::MaxLanes(lanes::D());
  hn::Vec<lanes::D> s[I][V];
#pragma GCC unroll 4
  for (int ii = 0; ii < I; ++ii)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) s[ii][v] = hn::Zero(d);
  for (int64_t r = 0; r < rows; ++r) {
    hn::Vec<lanes::D> b[I];
#pragma GCC unroll 4
    for (int ii = 0; ii < I; ++ii) b[ii] = hn::Set(d, x[r * kItemRows + ii]);
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      const auto yv = hn::LoadU(d, y + r * q + v * N);
#pragma GCC unroll 4
      for (int ii = 0; ii < I; ++ii) s[ii][v] = hn::MulAdd(b[ii], yv, s[ii][v]);
    }
  }
  using Out = std::conditional_t<kBf16Out, uint16_t, float>;
#pragma GCC unroll 4
  for (int ii = 0; ii < I; ++ii) {
    Out* out = static_cast<Out*>(c_row) + ii * ldc;
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      auto sum = s[ii][v];
      if (accumulate) sum = hn::Add(sum, LoadLanes<kBf16Out>(d, out, v * N));
      StoreLanes<kBf16Out, kStream>(d, sum, out, v * N);
    }
  }
}

// One item: output rows [i0, i1) of a group of `rows` rows, C's rows from c_rows.
template <bool kBf16Out, bool kStream>
void Item(const float* x, const float* y, int64_t q, int64_t rows, int64_t i0, int64_t i1,
          char* c_rows, int64_t ldc, bool accumulate) {
  const int64_t n = static_cast<int64_t>(hn::Lanes(lanes::D()));
  using Out = std::conditional_t<kBf16Out, uint16_t, float>;
  for (int64_t c0 = 0; c0 < q; c0 += kBlockCols) {
    const int64_t c1 = std::min(c0 + kBlockCols, q);
    for (int64_t i = i0; i < i1; i += kTileRows) {
      const float* xi = x + (i - i0);
      Out* c_row = reinterpret_cast<Out*>(c_rows) + (i - i0) * ldc;
      const bool two = i + 1 < i1;
      int64_t c = c0;
      for (; c + kTileVecs * n <= c1; c += kTileVecs * n) {
        if (two) {
          Tile<2, kTileVecs, kBf16Out, kStream>(xi, y + c, q, rows, c_row + c, ldc, accumulate);
        } else {
          Tile<1, kTileVecs, kBf16Out, kStream>(xi, y + c, q, rows, c_row + c, ldc, accumulate);
        }
      }
      for (; c + n <= c1; c += n) {
        if (two) {
          Tile<2, 1, kBf16Out, kStream>(xi, y + c, q, rows, c_row + c, ldc, accumulate);
        } else {
          Tile<1, 1, kBf16Out, kStream>(xi, y + c, q, rows, c_row + c, ldc, accumulate);
        }
      }
      for (; c < c1; ++c) {  // the last columns, short of a vector
        for (int ii = 0; ii < (two ? 2 : 1); ++ii) {
          float sum = 0.f;
          for (int64_t r = 0; r < rows; ++r)
            sum = std::fma(xi[r * kItemRows + ii], y[r * q + c], sum);
          Out* o = c_row + ii * ldc + c;
          if (accumulate) sum += as_float(*o);
          if constexpr (kBf16Out) {
            *o = float_to_bf16(sum);
          } else {
            *o = sum;
          }
        }
      }
    }
  }
}

// Zeros over `rows` of C's rows (ldc apart, `q` columns from c_rows), whole vectors with
// non-temporal stores (each row's start aligned for them), the rest with plain ones.
template <bool kBf16Out>
void ZeroStreamed(char* c_rows, int64_t ldc, int64_t rows, int64_t q) {
  const lanes::D d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  using Out = std::conditional_t<kBf16Out, uint16_t, float>;
  for (int64_t i = 0; i < rows; ++i) {
    Out* row = reinterpret_cast<Out*>(c_rows) + i * ldc;
    int64_t c = 0;
    for (; c + n <= q; c += n) StoreLanes<kBf16Out, true>(d, hn::Zero(d), row, c);
    std::fill(row + c, row + q, Out{0});
  }
}

}  // namespace

void RunOuter(const ContractionGroupedGemm& g) {
  const Groups& gr = g.groups;
  const size_t in_es = dtype_size(g.in_type), out_es = dtype_size(g.out_type);
  const bool out_bf16 = g.out_type == DType::kBF16;
  const int64_t per_group = (g.p + kItemRows - 1) / kItemRows;
  const int64_t items = gr.num_local * per_group;
  std::vector<int64_t> first_row(static_cast<size_t>(gr.num_local));
  int64_t row = local_rows(gr).begin;
  for (int64_t j = 0; j < gr.num_local; ++j) {
    first_row[static_cast<size_t>(j)] = row;
    row += gr.sizes[gr.offset + j];
  }
  const auto* xs = static_cast<const char*>(g.x);
  const auto* ys = static_cast<const char*>(g.y);
  auto* cs = static_cast<char*>(g.c);
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t lanes_n = static_cast<int64_t>(hn::Lanes(lanes::D()));
    std::vector<float> x, y;
    int64_t y_group = -1;
    for (int64_t it = items * t / threads; it < items * (t + 1) / threads; ++it) {
      const int64_t j = it / per_group, i0 = it % per_group * kItemRows;
      const int64_t i1 = std::min(i0 + kItemRows, g.p);
      const int64_t rows = gr.sizes[gr.offset + j], r0 = first_row[static_cast<size_t>(j)];
      char* c_rows = cs + (j * g.c_batch + i0 * g.ldc) * out_es;
      // Non-temporal stores where every whole vector of C's rows is aligned for them.
      const bool stream = StreamAligned(c_rows, out_es) && g.ldc % lanes_n == 0;
      if (rows == 0) {  // an empty group: 0, or left as it was
        if (g.accumulate) continue;
        if (stream) {
          (out_bf16 ? ZeroStreamed<true> : ZeroStreamed<false>)(c_rows, g.ldc, i1 - i0, g.q);
        } else {
          zero_rows(c_rows, g.out_type, g.ldc, g.q, 0, i1 - i0);
        }
        continue;
      }
      if (y_group != j) {
        y.resize(static_cast<size_t>(rows * g.q));
        for (int64_t r = 0; r < rows; ++r) {
          load_row_as_float(ys + (r0 + r) * g.ldy * in_es, g.in_type, g.q, y.data() + r * g.q);
        }
        y_group = j;
      }
      x.resize(static_cast<size_t>(rows * kItemRows));
      for (int64_t r = 0; r < rows; ++r) {
        load_row_as_float(xs + ((r0 + r) * g.ldx + i0) * in_es, g.in_type, i1 - i0,
                          x.data() + r * kItemRows);
      }
      auto* item = out_bf16 ? (stream ? Item<true, true> : Item<true, false>)
                            : (stream ? Item<false, true> : Item<false, false>);
      item(x.data(), y.data(), g.q, rows, i0, i1, c_rows, g.ldc, g.accumulate);
    }
    stream_fence();  // before the caller reads what this thread streamed
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace moekit::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moekit::detail {

HWY_EXPORT(RunOuter);

bool contraction_stream_picks(const ContractionGroupedGemm& g) {
  for (int64_t j = 0; j < g.groups.num_local; ++j) {
    if (g.groups.sizes[g.groups.offset + j] > kOuterMostRows) return false;
  }
  return true;
}

Status contraction_grouped_gemm_stream(const ContractionGroupedGemm& g) {
  if (g.p == 0 || g.q == 0) return {};
  HWY_DYNAMIC_DISPATCH(RunOuter)(g);
  return {};
}

}  // namespace moekit::detail
#endif  // HWY_ONCE
