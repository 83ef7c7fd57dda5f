// ragged_dot's forward on packed weights (pack_ragged_rhs, RaggedDotOptions::rhs_packed): the
// packed layout against its formula written here from the header's, and the forward against an
// oracle on the unpacked weights (double accumulation), bf16 and f32, for every CPU kernel, every
// Highway target, the reference, odd sizes, empty groups, one group holding every row, shards,
// accumulation and both output dtypes; blocks of the contraction; its batch invariance; the
// errors.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <hwy/targets.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpu/grouped_gemm.h"
#include "host_tensor.h"
#include "moekit/ragged_dot.h"

namespace moekit {
namespace {

HostTensor packed_tensor(int64_t E, int64_t K, int64_t n, DType dtype = DType::kBF16) {
  const PackedRhsShape s = packed_rhs_shape(E, K, n, dtype);
  return HostTensor(dtype, {s.dims[0], s.dims[1], s.dims[2]});
}

// Weights [E, K, n] packed (from that layout, or from its [E, n, K] copy: the same bytes).
HostTensor pack(HostTensor& w, bool from_transposed = false) {
  const int64_t E = w.shape[0], K = w.shape[1], n = w.shape[2];
  HostTensor out = packed_tensor(E, K, n, w.dtype);
  RaggedDotOptions o;
  o.rhs_transposed = from_transposed;
  HostTensor t = from_transposed ? transposed_matrices(w) : HostTensor(w.dtype, {0, 0, 0});
  const Status s = pack_ragged_rhs(from_transposed ? t.in() : w.in(), out.mut(), o);
  EXPECT_TRUE(s.ok()) << s.message();
  return out;
}

TEST(RaggedDotPacked, Shape) {
  auto dims = [](int64_t E, int64_t K, int64_t n, DType dtype = DType::kBF16) {
    const PackedRhsShape s = packed_rhs_shape(E, K, n, dtype);
    return std::vector<int64_t>{s.dims[0], s.dims[1], s.dims[2]};
  };
  EXPECT_EQ(dims(3, 5, 33), (std::vector<int64_t>{3, 2, 192}));
  EXPECT_EQ(dims(1, 4096, 28672), (std::vector<int64_t>{1, 896, 131072}));
  EXPECT_EQ(dims(2, 0, 32), (std::vector<int64_t>{2, 1, 0}));
  EXPECT_EQ(dims(2, 1, 0), (std::vector<int64_t>{2, 0, 64}));
  EXPECT_EQ(dims(-1, 4, 4), (std::vector<int64_t>{-1, -1, -1}));
  EXPECT_EQ(dims(1, -4, 4), (std::vector<int64_t>{-1, -1, -1}));
  const int64_t big = std::numeric_limits<int64_t>::max() / 4;
  EXPECT_EQ(dims(1, big, 64), (std::vector<int64_t>{-1, -1, -1}));  // 64 K elements a panel
  EXPECT_EQ(dims(1 << 22, 1 << 22, 1 << 22), (std::vector<int64_t>{-1, -1, -1}));  // 2^66
  // f32: one contraction row a word, 32 K elements a panel.
  EXPECT_EQ(dims(3, 5, 33, DType::kF32), (std::vector<int64_t>{3, 2, 160}));
  EXPECT_EQ(dims(1, 7168, 2048, DType::kF32), (std::vector<int64_t>{1, 64, 229376}));
  EXPECT_EQ(dims(2, 0, 32, DType::kF32), (std::vector<int64_t>{2, 1, 0}));
  EXPECT_EQ(dims(2, 1, 0, DType::kF32), (std::vector<int64_t>{2, 0, 32}));
  EXPECT_EQ(dims(1, big / 4, 64, DType::kF32), (std::vector<int64_t>{-1, -1, -1}));
  EXPECT_EQ(dims(1, big / 64, 64, DType::kF32), (std::vector<int64_t>{1, 2, (big / 64) * 32}));
  EXPECT_EQ(dims(1, 4, 4, DType::kF16), (std::vector<int64_t>{-1, -1, -1}));
  EXPECT_EQ(dims(1, 4, 4, DType::kI32), (std::vector<int64_t>{-1, -1, -1}));
}

// Element e of panel p of group j holds (k, c) = (2 (e / 64) + e % 2, 32 p + (e % 64) / 2) in
// bf16, (e / 32, 32 p + e % 32) in f32, or 0 past the weights' edges: every element, from both
// layouts.
TEST(RaggedDotPacked, LayoutIsTheHeadersFormula) {
  std::mt19937 rng(3);
  for (auto [K, n, dtype] : {std::tuple<int64_t, int64_t, DType>{7, 70, DType::kBF16},
                             {1, 1, DType::kBF16},
                             {64, 32, DType::kBF16},
                             {9, 33, DType::kBF16},
                             {7, 70, DType::kF32},
                             {1, 1, DType::kF32},
                             {9, 33, DType::kF32}}) {
    SCOPED_TRACE(fmt::format("K {} n {} {}", K, n, dtype_name(dtype)));
    HostTensor w(dtype, {3, K, n});
    w.fill_random(rng);
    for (bool from_transposed : {false, true}) {
      SCOPED_TRACE(from_transposed ? "from [E, n, K]" : "from [E, K, n]");
      const HostTensor p = pack(w, from_transposed);
      int failures = 0;
      for (int64_t j = 0; j < 3 && failures < 5; ++j) {
        for (int64_t q = 0; q < p.shape[1]; ++q) {
          for (int64_t e = 0; e < p.shape[2] && failures < 5; ++e) {
            const bool f32 = dtype == DType::kF32;
            const int64_t k = f32 ? e / 32 : 2 * (e / 64) + e % 2;
            const int64_t c = f32 ? 32 * q + e % 32 : 32 * q + (e % 64) / 2;
            const double want = k < K && c < n ? w.get({j, k, c}) : 0.0;
            if (p.get({j, q, e}) != want) {
              ADD_FAILURE() << "group " << j << " panel " << q << " element " << e << " (k " << k
                            << ", c " << c << "): " << p.get({j, q, e}) << ", want " << want;
              ++failures;
            }
          }
        }
      }
    }
  }
}

struct Call {
  int64_t K, n;
  std::vector<int32_t> sizes;
  int32_t offset = 0;
  int64_t e_loc = 0;  // 0: every group
  DType out = DType::kF32;
  bool accumulate = false;
  int64_t row_pad = 0;
  DType in = DType::kBF16;  // lhs and the weights
};

// The forward of `call` on packed weights with `impl`, against an oracle on the unpacked weights:
// local rows within f32 accumulation's error (and one bf16 rounding), the other rows exactly 0
// or (accumulate) as they were; the non-local rows of lhs hold NaN. Returns the output.
HostTensor check_forward(const Call& call, RaggedDotImpl impl, uint32_t seed = 7) {
  std::mt19937 rng(seed);
  int64_t m = 0;
  for (int32_t s : call.sizes) m += s;
  m += 3;  // rows past the groups
  const auto G = static_cast<int64_t>(call.sizes.size());
  const int64_t e_loc = call.e_loc > 0 ? call.e_loc : G;
  HostTensor lhs(call.in, {m, call.K}, call.row_pad), w(call.in, {e_loc, call.K, call.n});
  HostTensor out(call.out, {m, call.n}, call.row_pad);
  lhs.fill_random(rng);
  w.fill_random(rng);
  out.fill_random(rng);
  const HostTensor before = out;
  std::vector<int64_t> group(m, -1);  // local group of each row
  for (int64_t j = 0, r = 0; j < G; r += call.sizes[j], ++j) {
    for (int64_t i = r; i < r + call.sizes[j]; ++i) {
      if (j >= call.offset && j < call.offset + e_loc) group[i] = j - call.offset;
    }
  }
  for (int64_t r = 0; r < m; ++r) {
    if (group[r] >= 0) continue;
    for (int64_t k = 0; k < call.K; ++k) lhs.set({r, k}, std::numeric_limits<double>::quiet_NaN());
  }
  HostTensor p = pack(w);
  RaggedDotOptions o;
  o.rhs_packed = true;
  o.accumulate = call.accumulate;
  o.impl = impl;
  RaggedDotImpl ran = RaggedDotImpl::kAuto;
  o.ran = &ran;
  const Status s = ragged_dot(lhs.in(), p.in(), {call.sizes, call.offset}, out.mut(), o);
  EXPECT_TRUE(s.ok()) << s.message();
  EXPECT_STREQ(impl_name(ran),
               impl_name(impl == RaggedDotImpl::kAuto ? RaggedDotImpl::kCpuStream : impl));
  int failures = 0;
  for (int64_t r = 0; r < m && failures < 5; ++r) {
    for (int64_t c = 0; c < call.n && failures < 5; ++c) {
      const double got = out.get({r, c}), was = call.accumulate ? before.get({r, c}) : 0.0;
      if (group[r] < 0) {
        if (!(got == was)) {
          ADD_FAILURE() << "non-local row " << r << " col " << c << ": " << got << ", want " << was;
          ++failures;
        }
        continue;
      }
      double want = was, abs_sum = std::abs(was);
      for (int64_t k = 0; k < call.K; ++k) {
        const double t = lhs.get({r, k}) * w.get({group[r], k, c});
        want += t, abs_sum += std::abs(t);
      }
      double tol = (call.K + 4) * 1.2e-7 * abs_sum + 1e-30;
      if (call.out == DType::kBF16) tol += std::ldexp(std::abs(want), -8);
      if (!(std::abs(got - want) <= tol)) {
        ADD_FAILURE() << "row " << r << " (group " << group[r] << ") col " << c << ": " << got
                      << ", want " << want << " +- " << tol;
        ++failures;
      }
    }
  }
  return out;
}

// Odd contractions (the last pair half past the rows), columns short of a panel, empty groups,
// chunks of 1-8 rows and several chunks (9, 12, 16, 17, 40 rows; on AVX2 chunks of up to 3 rows
// in f32, and over each half of a panel from 8 rows in bf16), one group holding every row, a
// shard, accumulation, a bf16 output and padded rows; in bf16, then the same in f32 (an f32
// output: f32 rows take no other).
std::vector<Call> calls() {
  std::vector<Call> bf16 = {
      {1, 1, {1}},
      {7, 70, {3, 0, 9, 1, 12, 5}},
      {64, 32, {16, 17, 2, 0, 40, 8}},
      {33, 97, {0, 0, 21}},
      {130, 64, {4, 6, 7, 3}, 1, 2},
      {15, 40, {2, 11, 5}, 0, 0, DType::kBF16},
      {20, 50, {6, 8, 0, 1}, 0, 0, DType::kF32, true},
      {31, 45, {9, 3}, 0, 0, DType::kBF16, true, 5},
      // On AVX2, the halves in bf16 (f32: chunks of 3 rows) on a shard, accumulating, the last
      // panel's second half 2 columns wide.
      {19, 50, {3, 17, 20, 4}, 1, 2, DType::kF32, true},
      {0, 40, {3, 2}},                           // no contraction: the rows are 0
      {0, 40, {3, 2}, 0, 0, DType::kF32, true},  // ... or left as they were
      {5, 0, {2, 3}},                            // no columns
  };
  std::vector<Call> all = bf16;
  for (Call c : bf16) {
    c.in = c.out = DType::kF32;
    all.push_back(c);
  }
  return all;
}

TEST(RaggedDotPacked, ForwardAgainstTheOracle) {
  for (const Call& call : calls()) {
    SCOPED_TRACE(fmt::format("{} K {} n {} sizes {} offset {}", dtype_name(call.in), call.K, call.n,
                             call.sizes.size(), call.offset));
    for (RaggedDotImpl impl : {RaggedDotImpl::kAuto, RaggedDotImpl::kReference}) {
      SCOPED_TRACE(impl_name(impl));
      check_forward(call, impl);
    }
    // The threads' shares of the panels on 1-3 threads (each panel once).
    const int was = omp_get_max_threads();
    for (int threads = 1; threads <= 3; ++threads) {
      SCOPED_TRACE(fmt::format("stream on {} threads", threads));
      omp_set_num_threads(threads);
      check_forward(call, RaggedDotImpl::kCpuStream);
    }
    omp_set_num_threads(was);
  }
}

// The Highway kernels on every target this build has, and the AVX512-BF16 one where the CPU has it.
TEST(RaggedDotPacked, EveryKernelAgainstTheOracle) {
  detail::set_packed_pairs_for_test(0);
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    hwy::SetSupportedTargetsForTest(target);
    for (const Call& call : calls()) check_forward(call, RaggedDotImpl::kCpuStream);
  }
  hwy::SetSupportedTargetsForTest(0);
  detail::set_packed_pairs_for_test(1);  // where the CPU has AVX512-BF16 (else the Highway ones)
  for (const Call& call : calls()) check_forward(call, RaggedDotImpl::kCpuStream);
  detail::set_packed_pairs_for_test(-1);
}

// A group whose rows read a panel more than once walks a panel longer than 4 blocks in blocks of
// the contraction, its sums kept between them: in blocks of 3 steps (3 contraction rows in f32, 3
// pairs in bf16: the last block of an odd contraction ends on half a pair; panels past 12 steps),
// every call of calls() and a group of 70 rows (two bands of rows) against the oracle, on every
// kernel, then the same bits as unblocked.
TEST(RaggedDotPacked, BlocksOfTheContraction) {
  std::vector<Call> all = calls();
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    all.push_back({41, 45, {2, 70, 9}, 0, 0, dtype, false, 0, dtype});
  }
  auto each_kernel = [&](auto&& check) {
    for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
      SCOPED_TRACE(hwy::TargetName(target));
      hwy::SetSupportedTargetsForTest(target);
      detail::set_packed_pairs_for_test(0);
      check();
    }
    hwy::SetSupportedTargetsForTest(0);
    detail::set_packed_pairs_for_test(1);  // where the CPU has AVX512-BF16
    check();
    detail::set_packed_pairs_for_test(-1);
  };
  each_kernel([&] {
    for (const Call& call : all) {
      SCOPED_TRACE(fmt::format("{} K {} n {} sizes {}", dtype_name(call.in), call.K, call.n,
                               call.sizes.size()));
      detail::set_packed_block_steps_for_test(3);
      const HostTensor blocked = check_forward(call, RaggedDotImpl::kCpuStream);
      detail::set_packed_block_steps_for_test(int64_t{1} << 40);
      const HostTensor whole = check_forward(call, RaggedDotImpl::kCpuStream);
      EXPECT_EQ(blocked.bytes, whole.bytes);
    }
  });
  detail::set_packed_block_steps_for_test(0);
  // The machine's blocks: an eighth of L2 in steps of 128 bytes, at least 64.
  EXPECT_EQ(detail::packed_block_steps(int64_t{512} << 10), 512);  // AMD EPYC Zen 3
  EXPECT_EQ(detail::packed_block_steps(int64_t{2} << 20), 2048);   // Xeon
  EXPECT_EQ(detail::packed_block_steps(0), 512);                   // sysconf's "unknown"
  EXPECT_EQ(detail::packed_block_steps(-1), 512);
  EXPECT_EQ(detail::packed_block_steps(int64_t{32} << 10), 64);
}

// A row's output is the same bits in the batch-invariant mode whatever the rows beside it and
// the threads: one row alone in its group, then the same row among 12 others of a bigger group.
// The input gradient on the weights' transpose packed (pack_ragged_rhs reading [E, K, n] as
// [E, n', K']), against an oracle on the weights (double accumulation): every call of calls()
// with lhs and out's roles swapped (d_out [m, n], d_lhs [m, K]; accumulation as the call says),
// on kAuto, the reference and the stream on 1-3 threads; then the same bits as the forward
// through that packing.
TEST(RaggedDotPacked, InputGradientOnTheTransposePacked) {
  for (const Call& call : calls()) {
    SCOPED_TRACE(fmt::format("{} K {} n {} sizes {} offset {}", dtype_name(call.in), call.K, call.n,
                             call.sizes.size(), call.offset));
    std::mt19937 rng(11);
    int64_t m = 3;
    for (int32_t s : call.sizes) m += s;
    const auto G = static_cast<int64_t>(call.sizes.size());
    const int64_t e_loc = call.e_loc > 0 ? call.e_loc : G;
    HostTensor d_out(call.in, {m, call.n}), w(call.in, {e_loc, call.K, call.n});
    d_out.fill_random(rng);
    w.fill_random(rng);
    RaggedDotOptions flip;
    flip.rhs_transposed = true;
    const PackedRhsShape s = packed_rhs_shape(e_loc, call.n, call.K, call.in);
    HostTensor packed_t(call.in, {s.dims[0], s.dims[1], s.dims[2]});
    ASSERT_TRUE(pack_ragged_rhs(w.in(), packed_t.mut(), flip).ok());
    std::vector<int64_t> group(m, -1);
    for (int64_t j = 0, r = 0; j < G; r += call.sizes[j], ++j) {
      for (int64_t i = r; i < r + call.sizes[j]; ++i) {
        if (j >= call.offset && j < call.offset + e_loc) group[i] = j - call.offset;
      }
    }
    RaggedDotOptions o;
    o.rhs_packed = true;
    o.accumulate = call.accumulate;
    const int was = omp_get_max_threads();
    for (int v = 0; v < 5; ++v) {  // kAuto, the reference, the stream on 1 / 2 / 3 threads
      o.impl = v == 0 ? RaggedDotImpl::kAuto
                      : (v == 1 ? RaggedDotImpl::kReference : RaggedDotImpl::kCpuStream);
      omp_set_num_threads(v < 2 ? was : v - 1);
      SCOPED_TRACE(fmt::format("{} on {} threads", impl_name(o.impl), omp_get_max_threads()));
      HostTensor d_lhs(call.out, {m, call.K});
      d_lhs.fill_random(rng);
      const HostTensor before = d_lhs;
      const Status st =
          ragged_dot_dlhs(d_out.in(), packed_t.in(), {call.sizes, call.offset}, d_lhs.mut(), o);
      ASSERT_TRUE(st.ok()) << st.message();
      int failures = 0;
      for (int64_t r = 0; r < m && failures < 5; ++r) {
        for (int64_t k = 0; k < call.K && failures < 5; ++k) {
          const double was_there = call.accumulate ? before.get({r, k}) : 0.0;
          double want = was_there, abs_sum = std::abs(was_there);
          for (int64_t c = 0; group[r] >= 0 && c < call.n; ++c) {
            const double t = d_out.get({r, c}) * w.get({group[r], k, c});
            want += t, abs_sum += std::abs(t);
          }
          double tol = (call.n + 4) * 1.2e-7 * abs_sum + 1e-30;
          if (call.out == DType::kBF16) tol += std::ldexp(std::abs(want), -8);
          if (!(std::abs(d_lhs.get({r, k}) - want) <= tol)) {
            ADD_FAILURE() << "row " << r << " col " << k << ": " << d_lhs.get({r, k}) << ", want "
                          << want << " +- " << tol;
            ++failures;
          }
        }
      }
    }
    omp_set_num_threads(was);
    // The input gradient is the forward of d_out through the transpose's packing, to the bit.
    o.impl = RaggedDotImpl::kAuto;
    o.accumulate = false;
    HostTensor a(call.out, {m, call.K}), b(call.out, {m, call.K});
    ASSERT_TRUE(
        ragged_dot_dlhs(d_out.in(), packed_t.in(), {call.sizes, call.offset}, a.mut(), o).ok());
    ASSERT_TRUE(ragged_dot(d_out.in(), packed_t.in(), {call.sizes, call.offset}, b.mut(), o).ok());
    EXPECT_EQ(a.bytes, b.bytes);
  }
}

class RaggedDotPackedDtype : public ::testing::TestWithParam<DType> {};

TEST_P(RaggedDotPackedDtype, BatchInvariant) {
  std::mt19937 rng(9);
  const int64_t K = 77, n = 40;
  HostTensor w(GetParam(), {2, K, n}), lhs(GetParam(), {20, K});
  w.fill_random(rng);
  lhs.fill_random(rng);
  HostTensor p = pack(w);
  RaggedDotOptions o;
  o.rhs_packed = true;
  o.batch_invariant = true;
  RaggedDotImpl ran = RaggedDotImpl::kAuto;
  o.ran = &ran;
  auto row_bits = [&](std::vector<int32_t> sizes, int64_t row, int threads) {
    HostTensor out(DType::kF32, {20, n});
    const int was = omp_get_max_threads();
    omp_set_num_threads(threads);
    const Status s = ragged_dot(lhs.in(), p.in(), sizes, out.mut(), o);
    omp_set_num_threads(was);
    EXPECT_TRUE(s.ok()) << s.message();
    std::vector<float> bits(n);
    std::memcpy(bits.data(), out.bytes.data() + row * n * sizeof(float), n * sizeof(float));
    return bits;
  };
  // Row 5: alone (groups {5, 1, ...}: local group 1), then the 6th of 19 or 18 rows of group 1
  // (on AVX2, a group of 1 row takes the whole panel and one of 18 its halves).
  const std::vector<float> alone = row_bits({5, 1}, 5, 1);
  EXPECT_STREQ(impl_name(ran), "stream");
  EXPECT_EQ(row_bits({0, 19}, 5, 2), alone);
  EXPECT_EQ(row_bits({2, 18}, 5, 2), alone);
  EXPECT_NE(row_bits({5, 1}, 5, 1), std::vector<float>(n, 0.f));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, RaggedDotPackedDtype, ::testing::Values(DType::kBF16, DType::kF32),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(RaggedDotPacked, BadInput) {
  const int64_t K = 5, n = 33, m = 4;
  HostTensor w(DType::kBF16, {2, K, n}), lhs(DType::kBF16, {m, K}), out(DType::kF32, {m, n});
  std::mt19937 rng(1);
  w.fill_random(rng);
  HostTensor p = pack(w);
  const std::vector<int32_t> sizes{1, 2};
  RaggedDotOptions o;
  o.rhs_packed = true;
  auto message = [](const Status& s) { return s.ok() ? std::string("ok") : s.message(); };
  auto expect_error = [&](const Status& s, const std::string& names) {
    EXPECT_FALSE(s.ok());
    EXPECT_NE(message(s).find(names), std::string::npos) << message(s);
  };
  // The input gradient does not take the forward's packing (it reads the transpose's), nor does
  // the weight gradient take packed weights.
  HostTensor d_out(DType::kBF16, {m, n}), d_lhs(DType::kF32, {m, K});
  expect_error(ragged_dot_dlhs(d_out.in(), p.in(), sizes, d_lhs.mut(), o), "rhs.shape[1]");
  HostTensor d_w(DType::kF32, {2, K, n});
  expect_error(ragged_dot_drhs(lhs.in(), d_out.in(), sizes, d_w.mut(), o), "options.rhs_packed");
  // Nor rhs_transposed beside it.
  RaggedDotOptions t = o;
  t.rhs_transposed = true;
  expect_error(ragged_dot(lhs.in(), p.in(), sizes, out.mut(), t), "rhs_transposed");
  // f32 rows against bf16 weights.
  HostTensor lhs32(DType::kF32, {m, K});
  expect_error(ragged_dot(lhs32.in(), p.in(), sizes, out.mut(), o), "rhs.dtype");
  // f32 rows against f32 weights packed as bf16's shape (160 elements a panel, not 192).
  HostTensor p32(DType::kF32, {2, 2, 192});
  expect_error(ragged_dot(lhs32.in(), p32.in(), sizes, out.mut(), o), "rhs.shape[2]");
  // Packed for another K or n.
  HostTensor wide(DType::kF32, {m, n + 32});
  expect_error(ragged_dot(lhs.in(), p.in(), sizes, wide.mut(), o), "rhs.shape[1]");
  HostTensor longer(DType::kBF16, {m, K + 2});
  expect_error(ragged_dot(longer.in(), p.in(), sizes, out.mut(), o), "rhs.shape[2]");
  // oneDNN does not read the layout.
  RaggedDotOptions d = o;
  d.impl = RaggedDotImpl::kOneDnn;
  expect_error(ragged_dot(lhs.in(), p.in(), sizes, out.mut(), d), "not packed");
  // Packing: f32 weights into bf16, f16 weights, f32 weights into bf16's shape, a packed tensor
  // of another shape, weights inside the packed buffer.
  HostTensor w32(DType::kF32, {2, K, n}), other = packed_tensor(2, K + 2, n);
  expect_error(pack_ragged_rhs(w32.in(), p.mut()), "packed.dtype");
  HostTensor w16(DType::kF16, {2, K, n}), p16(DType::kF16, {2, 2, 192});
  expect_error(pack_ragged_rhs(w16.in(), p16.mut()), "rhs.dtype");
  expect_error(pack_ragged_rhs(w32.in(), p32.mut()), "packed.shape[2]");
  expect_error(pack_ragged_rhs(w.in(), other.mut()), "packed.shape[2]");
  ConstTensorView inside = w.in();
  inside.data = p.bytes.data();  // 2 x 5 x 33 elements within the packed 2 x 2 x 192
  expect_error(pack_ragged_rhs(inside, p.mut()), "packed");
}

}  // namespace
}  // namespace moekit
