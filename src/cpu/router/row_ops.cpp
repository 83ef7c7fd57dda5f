// Vector math over one row, for the router kernels: exp, sigmoid and sqrt(softplus) maps with
// their sums, and max / sum / dot reductions. Written once with Highway and compiled for every
// x86 target it knows (SSE4, AVX2, AVX-512, ...); the widest the CPU supports is picked at run
// time. The tail of a row runs through a zero-padded vector, so that every element sees the
// same arithmetic and nothing is read or written past the row.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/router/row_ops.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Must come after foreach_target.h.
#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/lanes-inl.h"
#include "cpu/router/problems.h"
#include "cpu/router/scores-inl.h"

HWY_BEFORE_NAMESPACE();
namespace moekit::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using D = hn::ScalableTag<float>;
using V = hn::Vec<D>;

// Lanes [i, i + r) of x into a vector, 0 < r < N, the other lanes 0; and their store back.
// AVX2 and AVX-512 have masked f32 loads and stores that touch only those lanes; narrower
// targets go through a zero-padded buffer (slower: the vector load cannot be forwarded from the
// narrower stores that filled it).
HWY_INLINE V LoadTail(D d, const float* x, size_t r) {
#if HWY_TARGET <= HWY_AVX2
  return hn::MaskedLoad(hn::FirstN(d, r), d, x);
#else
  HWY_ALIGN float buf[HWY_MAX_BYTES / sizeof(float)] = {};
  std::memcpy(buf, x, r * sizeof(float));
  return hn::Load(d, buf);
#endif
}
HWY_INLINE void StoreTail(D d, V v, float* out, size_t r) {
#if HWY_TARGET <= HWY_AVX2
  hn::BlendedStore(v, hn::FirstN(d, r), d, out);
#else
  HWY_ALIGN float buf[HWY_MAX_BYTES / sizeof(float)];
  hn::Store(v, d, buf);
  std::memcpy(out, buf, r * sizeof(float));
#endif
}

// Runs `op` on every vector of x[0, n), writing y to out and returning the sum of the y. The
// tail's padding lanes are left out of the sum and of the output.
template <class Op>
HWY_INLINE float MapSum(const float* x, float* out, size_t n, Op op) {
  const D d;
  const size_t N = hn::Lanes(d);
  V acc = hn::Zero(d);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const V y = op(d, hn::LoadU(d, x + i));
    hn::StoreU(y, d, out + i);
    acc = hn::Add(acc, y);
  }
  if (i < n) {
    const size_t r = n - i;
    const V y = hn::IfThenElseZero(hn::FirstN(d, r), op(d, LoadTail(d, x + i, r)));
    acc = hn::Add(acc, y);
    StoreTail(d, y, out + i, r);
  }
  return hn::GetLane(hn::SumOfLanes(d, acc));
}

float RowExpShifted(const float* x, float shift, float* out, int64_t n) {
  return MapSum(x, out, static_cast<size_t>(n),
                [shift](D d, V v) { return rmath::ExpShifted(d, v, hn::Set(d, shift)); });
}

float RowSigmoid(const float* x, float* out, int64_t n) {
  return MapSum(x, out, static_cast<size_t>(n), [](D d, V v) { return rmath::Sigmoid(d, v); });
}

float RowSqrtSoftplus(const float* x, float* out, int64_t n) {
  return MapSum(x, out, static_cast<size_t>(n), [](D d, V v) { return rmath::SqrtSoftplus(d, v); });
}

float RowMax(const float* x, int64_t n) {
  const D d;
  const size_t N = hn::Lanes(d), len = static_cast<size_t>(n);
  V m = hn::Set(d, -HUGE_VALF);
  size_t i = 0;
  for (; i + N <= len; i += N) m = hn::Max(m, hn::LoadU(d, x + i));
  if (i < len) {
    const auto tail = hn::FirstN(d, len - i);
    m = hn::IfThenElse(tail, hn::Max(m, LoadTail(d, x + i, len - i)), m);
  }
  return hn::GetLane(hn::MaxOfLanes(d, m));
}

float RowDot(const float* a, const float* b, int64_t n) {
  const D d;
  const size_t N = hn::Lanes(d), len = static_cast<size_t>(n);
  V acc = hn::Zero(d);
  size_t i = 0;
  for (; i + N <= len; i += N) acc = hn::MulAdd(hn::LoadU(d, a + i), hn::LoadU(d, b + i), acc);
  float result = hn::GetLane(hn::SumOfLanes(d, acc));
  for (; i < len; ++i) result += a[i] * b[i];
  return result;
}

// Positions i in [0, n) with x[i] >= tau, in increasing order, into out (room for n); returns
// how many.
size_t SelectAtLeast(const float* x, size_t n, float tau, int32_t* out) {
  const D d;
  const hn::RebindToSigned<D> di;
  const size_t N = hn::Lanes(d);
  const V vtau = hn::Set(d, tau);
  size_t count = 0, i = 0;
  for (; i + N <= n; i += N) {
    const auto keep = hn::RebindMask(di, hn::Ge(hn::LoadU(d, x + i), vtau));
    const auto pos = hn::Add(hn::Iota(di, 0), hn::Set(di, static_cast<int32_t>(i)));
    // Compress in a register and store the whole vector: the lanes past the kept ones land at
    // out[count + ...] <= out[i + N - 1], inside the buffer, and are overwritten later or unused.
    // (The memory form of compress is microcoded and slow on some AMD cores.)
    hn::StoreU(hn::Compress(pos, keep), di, out + count);
    count += hn::CountTrue(di, keep);
  }
  for (; i < n; ++i) {
    if (x[i] >= tau) out[count++] = static_cast<int32_t>(i);
  }
  return count;
}

// The k-th largest of the N lanes of v (k <= N), duplicates counted: the largest lane value with
// at least k lanes >= it.
HWY_INLINE float KthLargestLane(D d, V v, size_t k) {
  const size_t N = hn::Lanes(d);
  HWY_ALIGN float lanes[HWY_MAX_BYTES / sizeof(float)];
  hn::Store(v, d, lanes);
  float best = -HUGE_VALF;
  for (size_t i = 0; i < N; ++i) {
    const bool enough = hn::CountTrue(d, hn::Ge(v, hn::Set(d, lanes[i]))) >= k;
    best = enough && lanes[i] > best ? lanes[i] : best;
  }
  return best;
}

int32_t RowTopCandidates(const float* x, int64_t n, int32_t k, int32_t* out) {
  // The maxima of k disjoint slices of x are k distinct elements, so the k-th largest of any
  // such maxima is <= the k-th largest element: everything in the top k is >= it.
  const D d;
  const size_t N = hn::Lanes(d), len = static_cast<size_t>(n);
  float tau = HUGE_VALF;
  if (static_cast<size_t>(k) <= N && len >= N) {
    // Slices = the lane columns of the row's vectors (the tail padded with -inf): one pass.
    V m = hn::LoadU(d, x);
    size_t i = N;
    for (; i + N <= len; i += N) m = hn::Max(m, hn::LoadU(d, x + i));
    if (i < len) {
      HWY_ALIGN float buf[HWY_MAX_BYTES / sizeof(float)];
      for (size_t j = 0; j < N; ++j) buf[j] = i + j < len ? x[i + j] : -HUGE_VALF;
      m = hn::Max(m, hn::Load(d, buf));
    }
    if (static_cast<size_t>(k) <= N / 2) {
      // Pairing lane i with lane N - 1 - i gives N / 2 >= k disjoint slices, and
      // the least of their maxima is a bound that costs one shuffle.
      tau = hn::GetLane(hn::MinOfLanes(d, hn::Max(m, hn::Reverse(d, m))));
    } else {
      tau = KthLargestLane(d, m, static_cast<size_t>(k));
    }
  } else {
    // Slices = k contiguous runs.
    for (int64_t c = 0; c < k; ++c) {
      const int64_t begin = c * n / k, end = (c + 1) * n / k;
      tau = std::min(tau, RowMax(x + begin, end - begin));
    }
  }
  return static_cast<int32_t>(SelectAtLeast(x, len, tau, out));
}

// Sum of the `count` largest of x[0, n) (count <= n): the maximum, taken as often as it occurs
// (up to what is still needed), then masked out, and again.
float RowTopSum(const float* x, int64_t n, int32_t count, float* work) {
  const D d;
  const size_t N = hn::Lanes(d), len = static_cast<size_t>(n);
  // work: x padded with -inf to whole vectors.
  const size_t padded = (len + N - 1) / N * N;
  std::memcpy(work, x, len * sizeof(float));
  for (size_t i = len; i < padded; ++i) work[i] = -HUGE_VALF;
  float sum = 0.0f;
  int32_t left = count;
  while (left > 0) {
    V m = hn::Set(d, -HUGE_VALF);
    for (size_t i = 0; i < padded; i += N) m = hn::Max(m, hn::LoadU(d, work + i));
    const V top = hn::MaxOfLanes(d, m);
    size_t equal = 0;
    for (size_t i = 0; i < padded; i += N) {
      const V w = hn::LoadU(d, work + i);
      const auto eq = hn::Eq(w, top);
      equal += hn::CountTrue(d, eq);
      hn::StoreU(hn::IfThenElse(eq, hn::Set(d, -HUGE_VALF), w), d, work + i);
    }
    if (equal == 0) return hn::GetLane(top);  // NaN in the row: no value compares equal
    // Added one at a time, largest first, as a sorted sum would: the same rounding.
    const float v = hn::GetLane(top);
    for (size_t i = 0; i < equal && left > 0; ++i, --left) sum += v;
  }
  return sum;
}

// The sum of the top `count` (1 or 2) of each of `groups` runs of `per_group` floats, per_group a
// whole number of vectors: one pass keeps, lane by lane, the largest and second largest of the
// run's vectors; the run's top two are then the largest lane and the larger of its second and the
// other lanes. Returns false when a run holds NaN (nothing can be ranked); the caller then sums
// with RowTopSum.
bool GroupTopSums(const float* x, int64_t groups, int64_t per_group, int32_t count, float* out) {
  const D d;
  const size_t N = hn::Lanes(d), len = static_cast<size_t>(per_group);
  if (count > 2 || len % N != 0) return false;
  for (int64_t g = 0; g < groups; ++g) {
    const float* run = x + g * per_group;
    V hi = hn::Set(d, -HUGE_VALF), lo = hi;
    for (size_t i = 0; i < len; i += N) {
      const V v = hn::LoadU(d, run + i);
      lo = hn::Max(lo, hn::Min(hi, v));
      hi = hn::Max(hi, v);
    }
    const V top = hn::MaxOfLanes(d, hi);
    const auto at_top = hn::Eq(hi, top);
    const size_t ties = hn::CountTrue(d, at_top);
    if (ties == 0) return false;  // NaN: no lane equals the "maximum"
    const float first = hn::GetLane(top);
    if (count == 1) {
      out[g] = first;
      continue;
    }
    // Added largest first, as RowTopSum does: the same rounding.
    const float second =
        ties > 1 ? first : hn::GetLane(hn::MaxOfLanes(d, hn::IfThenElse(at_top, lo, hi)));
    out[g] = first + second;
  }
  return true;
}

// The top k by ranking the candidates against each other, without branches on the data: a
// candidate's rank is the number of candidates greater than it plus the number equal to it at a
// lower position (so ties go to the lower index).
bool RowTopK(const float* x, int64_t n, int32_t k, int32_t* candidates, float* values,
             int32_t* out) {
  const int32_t count = RowTopCandidates(x, n, k, candidates);
  if (count < k) return false;
  const D d;
  const size_t N = hn::Lanes(d);
  const size_t padded = (static_cast<size_t>(count) + N - 1) / N * N;
  for (int32_t i = 0; i < count; ++i) values[i] = x[candidates[i]];
  for (size_t i = count; i < padded; ++i) values[i] = -HUGE_VALF;
  for (int32_t i = 0; i < count; ++i) {
    const V v = hn::Set(d, values[i]);
    size_t rank = 0;
    for (size_t j = 0; j < padded; j += N) {
      const V c = hn::LoadU(d, values + j);
      rank += hn::CountTrue(d, hn::Gt(c, v));
      if (j < static_cast<size_t>(i)) {
        rank += hn::CountTrue(d, hn::And(hn::Eq(c, v), hn::FirstN(d, i - j)));
      }
    }
    out[std::min<size_t>(rank, k)] = candidates[i];  // out[k] takes the ones left out
  }
  return true;
}

// The first vector-aligned float of work (which has room for kRowWorkPad more floats than used).
HWY_INLINE float* AlignedWork(float* work) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(work);
  return reinterpret_cast<float*>((p + HWY_MAX_BYTES - 1) / HWY_MAX_BYTES * HWY_MAX_BYTES);
}

// row[0, n) (f32) to dst as f32 or bf16 (see StoreRow).
template <bool kBf16, bool kStream>
void WriteRow(const float* row, size_t n, void* dst) {
  StoreRow<kBf16, kStream>(row, n, dst, [](V v) { return v; });
}

// Rows of one output built together in `work` ([rows, stride] elements from the first aligned
// vector, stride = n rounded up to whole vectors of T): zeroed, then value(r, i) stored (kAdd:
// added) at at[r * count + i] of row r, each a scalar store. The rows are
// read back for writing well after their stores, so no load waits on a store it cannot forward
// from. Returns the block; *stride receives its row stride.
template <typename T, bool kAdd = false, class Value>
HWY_INLINE T* BuildRows(size_t n, size_t rows, const int32_t* at, int32_t count, Value value,
                        float* work, size_t* stride_out) {
  const hn::ScalableTag<T> dt;
  const size_t N = hn::Lanes(dt), stride = (n + N - 1) / N * N;
  T* block = reinterpret_cast<T*>(AlignedWork(work));
  for (size_t i = 0; i < rows * stride; i += N) hn::Store(hn::Zero(dt), dt, block + i);
  const size_t per_row = static_cast<size_t>(count);
  for (size_t r = 0; r < rows; ++r) {
    T* row = block + r * stride;
    for (size_t j = r * per_row; j < (r + 1) * per_row; ++j) {
      T& slot = row[at[j]];
      slot = kAdd ? slot + value(r, j - r * per_row) : value(r, j - r * per_row);
    }
  }
  *stride_out = stride;
  return block;
}

char* BuildSparseRows(bool bf16, bool sum, int64_t n, int64_t rows, const int32_t* at,
                      const float* values, int64_t row_step, int64_t slot_step, int32_t count,
                      float* work, size_t* stride_bytes) {
  const size_t len = static_cast<size_t>(n), r = static_cast<size_t>(rows);
  size_t stride;
  const auto value = [=](size_t row, size_t slot) {
    return values[static_cast<int64_t>(row) * row_step + static_cast<int64_t>(slot) * slot_step];
  };
  float* block = sum ? BuildRows<float, true>(len, r, at, count, value, work, &stride)
                     : BuildRows<float>(len, r, at, count, value, work, &stride);
  if (bf16) {
    // Each row rounded in place: its bf16 lands in the first half of its own f32 row.
    for (size_t i = 0; i < r; ++i) {
      WriteRow<true, false>(block + i * stride, len, block + i * stride);
    }
  }
  *stride_bytes = stride * sizeof(float);
  return reinterpret_cast<char*>(block);
}

char* BuildMapRows(int64_t n, int64_t rows, const int32_t* at, int32_t count, float* work,
                   size_t* stride_bytes) {
  return reinterpret_cast<char*>(BuildRows<uint8_t>(
      static_cast<size_t>(n), static_cast<size_t>(rows), at, count,
      [](size_t, size_t) { return uint8_t{1}; }, work, stride_bytes));
}

}  // namespace moekit::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moekit::detail {

HWY_EXPORT(RowExpShifted);
HWY_EXPORT(RowSigmoid);
HWY_EXPORT(RowSqrtSoftplus);
HWY_EXPORT(RowMax);
HWY_EXPORT(RowDot);
HWY_EXPORT(RowTopK);
HWY_EXPORT(RowTopSum);
HWY_EXPORT(GroupTopSums);
HWY_EXPORT(BuildSparseRows);
HWY_EXPORT(BuildMapRows);

float row_exp_shifted(const float* x, float shift, float* out, int64_t n) {
  return HWY_DYNAMIC_DISPATCH(RowExpShifted)(x, shift, out, n);
}
float row_sigmoid(const float* x, float* out, int64_t n) {
  return HWY_DYNAMIC_DISPATCH(RowSigmoid)(x, out, n);
}
float row_sqrt_softplus(const float* x, float* out, int64_t n) {
  return HWY_DYNAMIC_DISPATCH(RowSqrtSoftplus)(x, out, n);
}
float row_max(const float* x, int64_t n) { return HWY_DYNAMIC_DISPATCH(RowMax)(x, n); }
float row_dot(const float* a, const float* b, int64_t n) {
  return HWY_DYNAMIC_DISPATCH(RowDot)(a, b, n);
}

bool row_top_k(const float* x, int64_t n, int32_t k, int32_t* candidates, float* values,
               int32_t* out) {
  return HWY_DYNAMIC_DISPATCH(RowTopK)(x, n, k, candidates, values, out);
}

void group_top_sums(const float* x, int64_t groups, int64_t per_group, int32_t count, float* work,
                    float* out) {
  if (HWY_DYNAMIC_DISPATCH(GroupTopSums)(x, groups, per_group, count, out)) return;
  for (int64_t g = 0; g < groups; ++g) {
    out[g] = HWY_DYNAMIC_DISPATCH(RowTopSum)(x + g * per_group, per_group, count, work);
  }
}

char* build_sparse_rows(DType t, bool sum, int64_t n, int64_t rows, const int32_t* at,
                        const float* values, int64_t row_step, int64_t slot_step, int32_t count,
                        float* work, size_t* stride_bytes) {
  return HWY_DYNAMIC_DISPATCH(BuildSparseRows)(t == DType::kBF16, sum, n, rows, at, values,
                                               row_step, slot_step, count, work, stride_bytes);
}
char* build_map_rows(int64_t n, int64_t rows, const int32_t* at, int32_t count, float* work,
                     size_t* stride_bytes) {
  return HWY_DYNAMIC_DISPATCH(BuildMapRows)(n, rows, at, count, work, stride_bytes);
}

}  // namespace moekit::detail
#endif  // HWY_ONCE
