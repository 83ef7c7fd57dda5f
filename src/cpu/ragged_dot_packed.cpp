// ragged_dot's forward (and the input gradient, on the transposes) on packed weights
// (RaggedDotOptions::rhs_packed, pack_ragged_rhs): each panel of 32 output columns holds its
// whole contraction front to back (as bf16 pairs, or one f32 a row), so a chunk of a group's rows
// walks one panel from its first word to its last with every row's 32 sums in registers, and
// each thread reads its run of panels as one sequential stream. Nothing is blocked
// or sliced: the sums are loaded and stored once per panel and chunk, where the [K, n] form
// (ragged_dot_stream.cpp) stores them once per block of weight rows and, on long weight rows, in
// L2. A chunk is at most 8 rows (on AVX512-BF16: 16 sums in registers; 12 rows as one chunk ran
// 1.2-1.3x slower than as two chunks of 6, by hand:
// bench/results/ragged_dot_small-cpu-2026-11-29-5/ chunks.txt); the chunks after a group's first
// read the panel again from L2 (a panel of a contraction of K takes 64 K bytes in bf16: 448 KiB
// at deepseek-v3's 7168; twice that in f32, past L2 there), while prefetching the next panel
// (Ahead, below).
//
// Three kernels: for bf16, on a CPU with AVX512-BF16 the pairs multiply as they lie (vdpbf16ps,
// written with intrinsics for that target and chosen at run time); elsewhere, through Highway,
// each 32-bit lane's two bf16 widen to f32 (the even one by a shift, the odd one by a mask) for
// two FMAs. For f32 (one contraction row a step), Highway's FMAs on the panel's row as it lies.
// A row's sums run over the contraction in one order whatever the other rows, the chunk it falls
// in or the threads: the batch-invariant mode takes this path as it is.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/ragged_dot_packed.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Must come after foreach_target.h.
#include <hwy/highway.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/convert.h"
#include "cpu/grouped_gemm.h"

#ifndef MOEKIT_RAGGED_DOT_PACKED_DECL
#define MOEKIT_RAGGED_DOT_PACKED_DECL
namespace moekit::detail::packed {

// Whether the calls run the AVX512-BF16 kernel: where the CPU has it, unless a test says not.
bool runs_pairs();
constexpr int64_t kPanel = kPackedPanel;
// The most rows of a chunk on AVX512-BF16 (2 x 8 sums of 16 lanes in registers).
constexpr int kPairRows = 8;
// A panel's sums as a kernel leaves them: [rows][kPanel] f32.
using Tile = float[kPairRows][kPanel];
// Lines a kernel prefetches into L2, one a contraction step: the next panel's, where a group's
// rows take several chunks. The first chunk of a panel waits on the memory and the others compute
// from L2; with each chunk fetching its share of the next panel, every chunk computes from L2
// (qwen3-30b-a3b at 16 rows a group 1.10-1.16x faster in f32 and bf16, mixtral-8x7b's gate|up
// 1.10-1.18x; deepseek-v3's panels of 448-896 KiB, two of which L2 does not hold, level:
// bench/results/ragged_dot_packed_f32-cpu-2026-11-29/ab-ahead.txt).
struct Ahead {
  const char* p = nullptr;
  int64_t lines = 0;
};
inline void prefetch_step(const Ahead& ahead, int64_t step) {
  if (step < ahead.lines) __builtin_prefetch(ahead.p + 64 * step, 0, 2);
}

// kernel.template operator()<rows>() for 1 <= rows <= R: a kernel compiled for each chunk height.
template <int R, class Kernel>
void with_rows(int rows, const Kernel& kernel) {
  if constexpr (R > 1) {
    if (rows < R) return with_rows<R - 1>(rows, kernel);
  }
  kernel.template operator()<R>();
}

// Adds `tile`'s first `cols` columns of `rows` rows to (accumulate) or writes them over c's rows
// from `row`, columns from `col`.
inline void store_tile(const RowGroupedGemm& g, const Tile& tile, int rows, int64_t row,
                       int64_t col, int64_t cols) {
  for (int r = 0; r < rows; ++r) {
    const int64_t o = (row + r) * g.ldc + col;
    for (int64_t c = 0; c < cols; ++c) {
      const float add = g.accumulate ? load_as_float(g.c, g.out_type, o + c) : 0.f;
      store_float(g.c, g.out_type, o + c, tile[r][c] + add);
    }
  }
}

// The AVX512-BF16 kernel: tile[r][c] = sum over k < kc of A[r][k] * the panel's (k, c), for r <
// rows <= kPairRows; A's rows lda apart (bf16 bits), the panel's pairs from `panel`.
void pairs_panel(int rows, const uint16_t* a, int64_t lda, int64_t kc, const uint32_t* panel,
                 Tile& tile, Ahead ahead);

}  // namespace moekit::detail::packed
#endif  // MOEKIT_RAGGED_DOT_PACKED_DECL

HWY_BEFORE_NAMESPACE();
namespace moekit::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
namespace {

using D = hn::ScalableTag<float>;
using DU = hn::RebindToUnsigned<D>;
// Vectors a panel's 32 columns take, and the most rows of a chunk: sums in at most half of the
// target's vector registers (the rest for the panel's widened pairs).
constexpr int kVecs = static_cast<int>(packed::kPanel / HWY_LANES(float));
constexpr int kRegisters = HWY_TARGET <= HWY_AVX3 ? 32 : 16;
constexpr int kRows = std::clamp(kRegisters / 2 / kVecs, 1, packed::kPairRows);

// R rows' sums over a panel's 32 columns, in registers: zero to start, stored into a tile.
template <int R>
struct Sums {
  static constexpr size_t N = HWY_LANES(float);
  hn::Vec<D> v[R][kVecs];
  Sums() {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < kVecs; ++j) v[r][j] = hn::Zero(D());
  }
  hn::Vec<D>* operator[](int r) { return v[r]; }
  void Store(packed::Tile& tile) const {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < kVecs; ++j) hn::StoreU(v[r][j], D(), tile[r] + j * N);
  }
};

// Widened from a panel's pairs: tile[r][c] as pairs_panel's, on f32 FMA.
template <int R>
HWY_NOINLINE void WidePanel(const uint16_t* a, int64_t lda, int64_t kc, const uint32_t* panel,
                            packed::Tile& tile, packed::Ahead ahead) {
  const D d;
  const DU du;
  constexpr size_t N = HWY_LANES(float);
  Sums<R> s;
  const auto high = hn::Set(du, 0xffff0000u);
  const int64_t pairs = (kc + 1) / 2;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    packed::prefetch_step(ahead, kp);
    const uint32_t* row = panel + kp * packed::kPanel;
    hn::Vec<D> even[kVecs], odd[kVecs];
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) {
      const auto x = hn::LoadU(du, row + v * N);
      even[v] = hn::BitCast(d, hn::ShiftLeft<16>(x));
      odd[v] = hn::BitCast(d, hn::And(x, high));
    }
    const bool last_odd = 2 * kp + 1 == kc;  // its second row is past A's rows: not read
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const uint16_t* ar = a + r * lda + 2 * kp;
      const auto a0 = hn::Set(d, bf16_to_float(ar[0]));
      const auto a1 = hn::Set(d, last_odd ? 0.f : bf16_to_float(ar[1]));
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) {
        s[r][v] = hn::MulAdd(a0, even[v], s[r][v]);
        s[r][v] = hn::MulAdd(a1, odd[v], s[r][v]);
      }
    }
  }
  s.Store(tile);
}

// The f32 kernel: tile[r][c] = sum over k < kc of A[r][k] * the panel's (k, c), the panel one
// f32 a column per contraction row; A's rows lda apart.
template <int R>
HWY_NOINLINE void FloatPanel(const float* a, int64_t lda, int64_t kc, const float* panel,
                             packed::Tile& tile, packed::Ahead ahead) {
  const D d;
  constexpr size_t N = HWY_LANES(float);
  Sums<R> s;
  for (int64_t k = 0; k < kc; ++k) {
    packed::prefetch_step(ahead, k);
    const float* row = panel + k * packed::kPanel;
    hn::Vec<D> b[kVecs];
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) b[v] = hn::LoadU(d, row + v * N);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const auto x = hn::Set(d, a[r * lda + k]);
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) s[r][v] = hn::MulAdd(x, b[v], s[r][v]);
    }
  }
  s.Store(tile);
}

}  // namespace

// The call: units of (local group, panel) split over the threads in contiguous runs of near-equal
// cost (a panel's bytes, times its group's rows over 16 past 16 rows, where the FMAs take longer
// than the read), each unit's rows in the fewest chunks of near-equal size.
void RunPacked(const RowGroupedGemm& g) {
  const bool f32 = g.in_type == DType::kF32, pairs = !f32 && packed::runs_pairs();
  const int most = pairs ? packed::kPairRows : kRows;
  const int64_t panels = (g.n + packed::kPanel - 1) / packed::kPanel;
  struct Group {
    int64_t j, row, rows;
  };
  std::vector<Group> busy;
  std::vector<int64_t> ends;  // cumulative cost at the end of each busy group's panels
  int64_t row = local_rows(g.groups).begin, cost = 0;
  for (int64_t j = 0; j < g.groups.num_local; ++j) {
    const int64_t rows = g.groups.sizes[g.groups.offset + j];
    if (rows > 0) {
      busy.push_back({j, row, rows});
      cost += panels * std::max<int64_t>(rows, 16);
      ends.push_back(cost);
    }
    row += rows;
  }
  const size_t elem = dtype_size(g.in_type);
  const auto* a = static_cast<const char*>(g.a);
  const auto* b = static_cast<const char*>(g.b);
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), threads = omp_get_num_threads();
    // This thread's units: those whose cost starts in [cost * t, cost * (t + 1)) / threads.
    const int64_t lo = cost * t / threads, hi = cost * (t + 1) / threads;
    alignas(64) packed::Tile tile;
    int64_t start = 0;
    for (size_t i = 0; i < busy.size(); ++i) {
      const Group& gr = busy[i];
      const int64_t unit = (ends[i] - start) / panels;  // each of its panels' cost
      // Its panels [p0, p1) start in [lo, hi).
      const int64_t p0 = std::clamp<int64_t>((lo - start + unit - 1) / unit, 0, panels);
      const int64_t p1 = std::clamp<int64_t>((hi - start + unit - 1) / unit, 0, panels);
      start = ends[i];
      const int64_t chunks = (gr.rows + most - 1) / most;
      for (int64_t p = p0; p < p1; ++p) {
        const char* panel = b + (gr.j * g.b_batch + p * g.b_s0) * elem;
        const int64_t col = p * packed::kPanel, cols = std::min(packed::kPanel, g.n - col);
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t r0 = gr.rows * c / chunks, r1 = gr.rows * (c + 1) / chunks;
          const int rows = static_cast<int>(r1 - r0);
          const char* ar = a + (gr.row + r0) * g.lda * elem;
          // Chunk c prefetches lines [c steps, (c + 1) steps) of the group's next panel.
          packed::Ahead ahead;
          if (chunks > 1 && p + 1 < p1) {
            const int64_t steps = f32 ? g.kc : (g.kc + 1) / 2, lines = 2 * steps;
            const int64_t first = std::min(lines, c * steps);
            ahead = {panel + g.b_s0 * elem + 64 * first, std::min(steps, lines - first)};
          }
          const auto* a16 = reinterpret_cast<const uint16_t*>(ar);
          const auto* pairs_of = reinterpret_cast<const uint32_t*>(panel);
          if (f32) {
            const auto* a32 = reinterpret_cast<const float*>(ar);
            const auto* f32_of = reinterpret_cast<const float*>(panel);
            packed::with_rows<kRows>(
                rows, [&]<int R>() { FloatPanel<R>(a32, g.lda, g.kc, f32_of, tile, ahead); });
          } else if (pairs) {
            packed::pairs_panel(rows, a16, g.lda, g.kc, pairs_of, tile, ahead);
          } else {
            packed::with_rows<kRows>(
                rows, [&]<int R>() { WidePanel<R>(a16, g.lda, g.kc, pairs_of, tile, ahead); });
          }
          packed::store_tile(g, tile, rows, gr.row + r0, col, cols);
        }
      }
    }
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace moekit::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moekit::detail {
namespace packed {

namespace {
std::atomic<int> pairs_for_test{-1};
}  // namespace

bool runs_pairs() {
  const int forced = pairs_for_test.load();
  return forced >= 0 ? forced == 1 && stream::has_avx512_bf16() : stream::has_avx512_bf16();
}

namespace {
template <int R>
MOEKIT_AVX512_BF16 void pairs_kernel(const uint16_t* a, int64_t lda, int64_t kc,
                                     const uint32_t* panel, Tile& tile, Ahead ahead) {
  __m512 s[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) s[r][0] = _mm512_setzero_ps(), s[r][1] = _mm512_setzero_ps();
  auto step = [&](int64_t kp, bool last_odd) MOEKIT_AVX512_BF16 {
    prefetch_step(ahead, kp);
    const __m512i v0 = _mm512_loadu_si512(panel + kp * kPanel);
    const __m512i v1 = _mm512_loadu_si512(panel + kp * kPanel + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      // The pair (A[r][2kp], A[r][2kp + 1]), or A[r][2kp] alone past A's last element.
      int32_t w;
      if (last_odd) {
        w = a[r * lda + 2 * kp];
      } else {
        std::memcpy(&w, a + r * lda + 2 * kp, sizeof(w));
      }
      const __m512bh av = (__m512bh)_mm512_set1_epi32(w);
      s[r][0] = _mm512_dpbf16_ps(s[r][0], av, (__m512bh)v0);
      s[r][1] = _mm512_dpbf16_ps(s[r][1], av, (__m512bh)v1);
    }
  };
  const int64_t full = kc / 2;
  for (int64_t kp = 0; kp < full; ++kp) step(kp, false);
  if (kc % 2 != 0) step(full, true);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    // Lane i of the pair vectors is column i (v0) and 16 + i (v1): the panel's own order.
    _mm512_store_ps(tile[r], s[r][0]);
    _mm512_store_ps(tile[r] + 16, s[r][1]);
  }
}
}  // namespace

void pairs_panel(int rows, const uint16_t* a, int64_t lda, int64_t kc, const uint32_t* panel,
                 Tile& tile, Ahead ahead) {
  with_rows<kPairRows>(rows, [&]<int R>() { pairs_kernel<R>(a, lda, kc, panel, tile, ahead); });
}

}  // namespace packed

HWY_EXPORT(RunPacked);

void row_grouped_gemm_packed(const RowGroupedGemm& g) { HWY_DYNAMIC_DISPATCH(RunPacked)(g); }
void set_packed_pairs_for_test(int mode) { packed::pairs_for_test = mode; }

}  // namespace moekit::detail
#endif  // HWY_ONCE
