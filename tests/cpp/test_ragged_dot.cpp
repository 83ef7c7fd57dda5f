// ragged_dot against an oracle written here from SPEC.md section 1 (per-row group lookup, double
// accumulation), for every implementation: the oneDNN one and the scalar reference.
#include <cpuid.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <hwy/targets.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "cpu/grouped_gemm.h"
#include "host_tensor.h"
#include "moekit/ragged_dot.h"

namespace moekit {
namespace {

struct Case {
  int64_t m, K, n;
  std::vector<int32_t> sizes;
  int32_t offset;
  int64_t e_loc;
  DType in = DType::kF32, out = DType::kF32;
  bool transposed = false;
  bool accumulate = false;
  bool batch_invariant = false;
  int64_t row_pad = 0;  // extra elements at the end of every row of every 2-D operand
  std::string name;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// Local group index of row r per SPEC section 1, or -1 for a row that no local group holds.
std::vector<int64_t> local_group_of_rows(const Case& c) {
  std::vector<int64_t> g(c.m, -1);
  int64_t start = 0;
  for (int64_t j = 0; j < static_cast<int64_t>(c.sizes.size()); ++j) {
    for (int64_t r = start; r < start + c.sizes[j]; ++r) {
      if (j >= c.offset && j < c.offset + c.e_loc) g[r] = j - c.offset;
    }
    start += c.sizes[j];
  }
  return g;
}

// Tolerance for one output element whose exact value is `ref` and whose terms sum to `abs_sum`
// in magnitude: f32 accumulation error, plus one bf16 rounding when the output is bf16.
double tolerance(const Case& c, int64_t terms, double ref, double abs_sum) {
  double tol = (terms + 4) * 1.2e-7 * abs_sum + 1e-30;
  if (c.out == DType::kBF16) tol += std::ldexp(std::abs(ref), -8);
  return tol;
}

class RaggedDotTest : public ::testing::TestWithParam<std::tuple<Case, RaggedDotImpl>> {
 protected:
  void SetUp() override {
    c = std::get<0>(GetParam());
    opt.rhs_transposed = c.transposed;
    opt.accumulate = c.accumulate;
    opt.batch_invariant = c.batch_invariant;
    opt.impl = std::get<1>(GetParam());
    rows = local_group_of_rows(c);
  }
  std::vector<int64_t> rhs_dims() const {
    return c.transposed ? std::vector<int64_t>{c.e_loc, c.n, c.K}
                        : std::vector<int64_t>{c.e_loc, c.K, c.n};
  }
  double rhs_at(const HostTensor& w, int64_t j, int64_t k, int64_t col) const {
    return c.transposed ? w.get({j, col, k}) : w.get({j, k, col});
  }
  // Poison what must never be read: rows that no local group holds.
  void poison_nonlocal_rows(HostTensor& t) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (int64_t r = 0; r < c.m; ++r) {
      if (rows[r] >= 0) continue;
      for (int64_t i = 0; i < t.shape[1]; ++i) t.set_flat(t.offset({r, i}), nan);
    }
  }

  RaggedDotGroups groups() const { return {c.sizes, c.offset}; }
  // The weight gradient's options: kCpuStream's sums of outer products take every size of group
  // outside the batch-invariant mode (its refusal there is tested on its own), where the gradient
  // runs kAuto.
  RaggedDotOptions drhs_options() const {
    RaggedDotOptions o = opt;
    if (o.impl == RaggedDotImpl::kCpuStream && o.batch_invariant) o.impl = RaggedDotImpl::kAuto;
    return o;
  }

  Case c;
  RaggedDotOptions opt;
  std::vector<int64_t> rows;
  std::mt19937 rng{1234};
};

// Checks `got` against `expect(r, col)` = (value, abs-sum, terms) on local rows, and on the
// other rows: exact 0, or (accumulate) the untouched previous contents `before`.
template <typename Expect>
void check_rows(const Case& c, const std::vector<int64_t>& rows, const HostTensor& got,
                const HostTensor& before, Expect&& expect) {
  int failures = 0;
  for (int64_t r = 0; r < c.m && failures < 5; ++r) {
    for (int64_t col = 0; col < got.shape[1] && failures < 5; ++col) {
      const double g = got.get({r, col});
      if (rows[r] < 0) {
        const double want = c.accumulate ? before.get({r, col}) : 0.0;
        if (!(g == want)) {
          ADD_FAILURE() << "non-local row " << r << " col " << col << ": got " << g << ", want "
                        << want;
          ++failures;
        }
        continue;
      }
      auto [ref, abs_sum, terms] = expect(r, col);
      if (c.accumulate) ref += before.get({r, col}), abs_sum += std::abs(before.get({r, col}));
      const double tol = tolerance(c, terms, ref, abs_sum);
      if (!(std::abs(g - ref) <= tol)) {
        ADD_FAILURE() << "row " << r << " (local group " << rows[r] << ") col " << col << ": got "
                      << g << ", want " << ref << " +- " << tol;
        ++failures;
      }
    }
  }
}

TEST_P(RaggedDotTest, Forward) {
  HostTensor lhs(c.in, {c.m, c.K}, c.row_pad), rhs(c.in, rhs_dims()),
      out(c.out, {c.m, c.n}, c.row_pad);
  lhs.fill_random(rng);
  rhs.fill_random(rng);
  out.fill_random(rng);
  poison_nonlocal_rows(lhs);
  const HostTensor before = out;
  ASSERT_TRUE(ragged_dot(lhs.in(), rhs.in(), groups(), out.mut(), opt).ok());
  check_rows(c, rows, out, before, [&](int64_t r, int64_t col) {
    double s = 0, a = 0;
    for (int64_t k = 0; k < c.K; ++k) {
      const double t = lhs.get({r, k}) * rhs_at(rhs, rows[r], k, col);
      s += t, a += std::abs(t);
    }
    return std::tuple(s, a, c.K);
  });
}

TEST_P(RaggedDotTest, InputGradient) {
  HostTensor d_out(c.in, {c.m, c.n}, c.row_pad), rhs(c.in, rhs_dims()),
      d_lhs(c.out, {c.m, c.K}, c.row_pad);
  d_out.fill_random(rng);
  rhs.fill_random(rng);
  d_lhs.fill_random(rng);
  poison_nonlocal_rows(d_out);
  const HostTensor before = d_lhs;
  ASSERT_TRUE(ragged_dot_dlhs(d_out.in(), rhs.in(), groups(), d_lhs.mut(), opt).ok());
  check_rows(c, rows, d_lhs, before, [&](int64_t r, int64_t k) {
    double s = 0, a = 0;
    for (int64_t col = 0; col < c.n; ++col) {
      const double t = d_out.get({r, col}) * rhs_at(rhs, rows[r], k, col);
      s += t, a += std::abs(t);
    }
    return std::tuple(s, a, c.n);
  });
}

TEST_P(RaggedDotTest, WeightGradient) {
  HostTensor lhs(c.in, {c.m, c.K}, c.row_pad), d_out(c.in, {c.m, c.n}, c.row_pad),
      d_rhs(c.out, rhs_dims());
  lhs.fill_random(rng);
  d_out.fill_random(rng);
  d_rhs.fill_random(rng);
  poison_nonlocal_rows(lhs);
  poison_nonlocal_rows(d_out);
  const HostTensor before = d_rhs;
  ASSERT_TRUE(ragged_dot_drhs(lhs.in(), d_out.in(), groups(), d_rhs.mut(), drhs_options()).ok());
  int failures = 0;
  for (int64_t j = 0; j < c.e_loc; ++j) {
    for (int64_t k = 0; k < c.K; ++k) {
      for (int64_t col = 0; col < c.n && failures < 5; ++col) {
        double s = 0, a = 0;
        int64_t terms = 0;
        for (int64_t r = 0; r < c.m; ++r) {
          if (rows[r] != j) continue;
          const double t = lhs.get({r, k}) * d_out.get({r, col});
          s += t, a += std::abs(t), ++terms;
        }
        const double old = c.transposed ? before.get({j, col, k}) : before.get({j, k, col});
        if (c.accumulate) s += old, a += std::abs(old);
        const double got = c.transposed ? d_rhs.get({j, col, k}) : d_rhs.get({j, k, col});
        // An empty group is exactly 0 (or untouched): no tolerance.
        const double tol = terms == 0 ? 0.0 : tolerance(c, terms, s, a);
        if (!(std::abs(got - s) <= tol)) {
          ADD_FAILURE() << "d_rhs[" << j << "][" << k << "][" << col << "] (" << terms
                        << " rows): got " << got << ", want " << s << " +- " << tol;
          ++failures;
        }
      }
    }
  }
}

// <ragged_dot(lhs, rhs), d_out> = <lhs, d_lhs> = <rhs, d_rhs>: the three passes are adjoint.
TEST_P(RaggedDotTest, PassesAreAdjoint) {
  opt.accumulate = false;  // the identity holds for the fresh products; outputs are f32 here
  HostTensor lhs(c.in, {c.m, c.K}), rhs(c.in, rhs_dims()), d_out(c.in, {c.m, c.n});
  HostTensor y(DType::kF32, {c.m, c.n}), d_lhs(DType::kF32, {c.m, c.K}),
      d_rhs(DType::kF32, rhs_dims());
  lhs.fill_random(rng);
  rhs.fill_random(rng);
  d_out.fill_random(rng);
  ASSERT_TRUE(ragged_dot(lhs.in(), rhs.in(), groups(), y.mut(), opt).ok());
  ASSERT_TRUE(ragged_dot_dlhs(d_out.in(), rhs.in(), groups(), d_lhs.mut(), opt).ok());
  ASSERT_TRUE(ragged_dot_drhs(lhs.in(), d_out.in(), groups(), d_rhs.mut(), drhs_options()).ok());
  double a = 0, b = 0, d = 0, scale = 1e-30;
  for (int64_t r = 0; r < c.m; ++r) {
    for (int64_t col = 0; col < c.n; ++col) a += y.get({r, col}) * d_out.get({r, col});
    for (int64_t k = 0; k < c.K; ++k) b += lhs.get({r, k}) * d_lhs.get({r, k});
  }
  for (int64_t j = 0; j < c.e_loc; ++j) {
    for (int64_t k = 0; k < c.K; ++k) {
      for (int64_t col = 0; col < c.n; ++col) {
        d += rhs_at(rhs, j, k, col) *
             (c.transposed ? d_rhs.get({j, col, k}) : d_rhs.get({j, k, col}));
      }
    }
  }
  scale += std::abs(a) + std::sqrt(static_cast<double>(c.m * c.K * c.n));
  EXPECT_NEAR(a, b, 1e-4 * scale);
  EXPECT_NEAR(a, d, 1e-4 * scale);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  std::mt19937 rng(7);
  auto add = [&](Case c, std::string name) {
    for (DType in : {DType::kF32, DType::kBF16}) {
      for (DType o : {DType::kF32, in}) {
        Case x = c;
        x.in = in, x.out = o;
        x.name = fmt::format("{}_{}_{}", name, dtype_name(in), dtype_name(o));
        out.push_back(x);
        if (in == DType::kF32) break;  // f32 in: f32 out only
      }
    }
  };
  // Odd sizes, every row in some group, one shard holding every group.
  for (int64_t m : {0, 1, 7, 111, 500}) {
    for (auto [K, n] : {std::pair<int64_t, int64_t>{13, 5}, {70, 33}}) {
      const int64_t G = 5;
      add({m, K, n, random_sizes(rng, G, m), 0, G}, fmt::format("m{}_K{}_n{}_all", m, K, n));
    }
  }
  // Sizes summing to less than m; several shards of a 12-group split (first, middle, last).
  for (int32_t shard : {0, 1, 3}) {
    const int64_t G = 12, e_loc = 3, m = 111;
    add({m, 37, 19, random_sizes(rng, G, 90), static_cast<int32_t>(shard * e_loc), e_loc},
        fmt::format("shard{}of4_partial", shard));
  }
  // Empty groups, also at both edges of the local range.
  add({60, 17, 9, {5, 0, 7, 20, 0, 0, 13, 0, 15, 0}, 1, 8}, "empty_groups_edges");
  add({40, 17, 9, {10, 0, 20, 0, 10}, 1, 3}, "empty_first_and_last_local");
  add({30, 8, 6, {10, 0, 0, 0, 20}, 1, 3}, "all_local_groups_empty");
  // Every row in one group: the first, a middle and the last.
  for (int g : {0, 3, 7}) {
    std::vector<int32_t> s(8, 0);
    s[g] = 111;
    add({111, 31, 23, s, 0, 8}, fmt::format("all_rows_in_group{}", g));
  }
  add({111, 31, 23, {0, 0, 111, 0}, 2, 1}, "all_rows_in_the_one_local_group");
  // Empty contraction (K = 0: every local row is exactly 0) and empty output width (n = 0).
  add({20, 0, 7, {5, 10, 5}, 1, 2}, "K0");
  add({20, 9, 0, {5, 10, 5}, 1, 2}, "n0");
  // Enough non-empty groups that the oneDNN path spreads groups over threads.
  add({500, 64, 48, random_sizes(rng, 32, 480), 8, 16}, "many_groups_shard");
  // Larger contraction, K and n not multiples of 16.
  add({300, 257, 129, random_sizes(rng, 6, 300), 0, 6}, "K257_n129");
  // The streaming kernel (kCpuStream): several 64-column panels and a partial one, contractions
  // of odd length and with whole and partial blocks of 16 pairs, groups of more rows than one
  // chunk of 6 (1 to 64 rows).
  add({300, 200, 140, {1, 64, 7, 0, 6, 13, 60, 2}, 0, 8}, "K200_n140_stream_rows");
  add({90, 75, 128, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, 2, 7}, "K75_n128_stream_shard");
  // A contraction past 4 KiB of bf16 (the input gradient's n = 2101, odd): kCpuStream's
  // transposed pairs for groups past 32 rows, a group of 200 in two runs, 33 and 37 beside an empty
  // one; all local, a shard of two, and (row padding, not transposed) leading dimensions past the
  // rows.
  add({270, 40, 2101, {200, 0, 37, 33}, 0, 4}, "K40_n2101_stream_long_dot");
  add({270, 40, 2101, {33, 200, 0, 37}, 1, 2}, "K40_n2101_stream_long_dot_shard");
  {
    Case c{270, 40, 2101, {37, 33, 0, 200}, 0, 4};
    c.row_pad = 3;
    add(c, "K40_n2101_stream_long_dot_rowpad");
  }
  // Fewer than 4 output columns: the dot-product form's padded path (the input gradient's K = 3;
  // the transposed forward's n = 2).
  add({40, 3, 2, {7, 0, 33}, 0, 3}, "K3_n2_stream_narrow");
  // One group of more rows than the batch-invariant mode's blocks.
  add({600, 33, 17, {600}, 0, 1}, "rows600_one_group");
  // A weight gradient of more rows (K) than the batch-invariant mode computes in one call, from a
  // group long enough that the mode splits it.
  add({40, 1100, 9, random_sizes(rng, 3, 40), 0, 3}, "K1100_n9");
  add({2100, 600, 5, {2050, 50}, 0, 2}, "K600_group2050");
  // Transposed rhs, accumulate, row padding: on a few of the shapes above.
  std::vector<Case> variants;
  for (const Case& c : out) {
    if (c.name.rfind("shard1", 0) == 0 || c.name.rfind("empty_groups_edges", 0) == 0 ||
        c.name.rfind("m111_K70", 0) == 0 || c.name.rfind("many_groups", 0) == 0 ||
        c.name.find("_stream_") != std::string::npos || c.name.rfind("K257", 0) == 0) {
      Case t = c;
      t.transposed = true, t.name += "_T";
      variants.push_back(t);
      Case a = c;
      a.accumulate = true, a.name += "_acc";
      variants.push_back(a);
      Case p = c;
      p.row_pad = 3, p.transposed = true, p.name += "_rowpad_T";
      variants.push_back(p);
    }
    // The batch-invariant mode: blocks of rows, small blocks padded, every call single-threaded.
    if (c.name.rfind("shard1", 0) == 0 || c.name.rfind("empty_groups_edges", 0) == 0 ||
        c.name.rfind("m111_K70", 0) == 0 || c.name.rfind("m1_", 0) == 0 ||
        c.name.rfind("many_groups", 0) == 0 || c.name.rfind("all_rows_in_group3", 0) == 0 ||
        c.name.rfind("K257", 0) == 0 || c.name.rfind("rows600", 0) == 0 ||
        c.name.rfind("K1100", 0) == 0 || c.name.rfind("K600", 0) == 0 ||
        c.name.rfind("K0", 0) == 0) {
      Case v = c;
      v.batch_invariant = true, v.name += "_inv";
      variants.push_back(v);
      v.transposed = true, v.accumulate = true, v.row_pad = 3, v.name += "_T_acc_rowpad";
      variants.push_back(v);
    }
  }
  out.insert(out.end(), variants.begin(), variants.end());
  return out;
}

std::string impl_suffix(RaggedDotImpl impl) {
  switch (impl) {
    case RaggedDotImpl::kReference:
      return "_ref";
    case RaggedDotImpl::kOneDnn:
      return "_onednn";
    case RaggedDotImpl::kCpuStream:
      return "_stream";
    default:
      return "_auto";
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, RaggedDotTest,
                         ::testing::Combine(::testing::ValuesIn(cases()),
                                            ::testing::Values(RaggedDotImpl::kAuto,
                                                              RaggedDotImpl::kOneDnn,
                                                              RaggedDotImpl::kReference)),
                         [](const auto& info) {
                           return std::get<0>(info.param).name +
                                  impl_suffix(std::get<1>(info.param));
                         });

// The calls kCpuStream takes: the default mode (any group sizes when asked for by name).
std::vector<Case> stream_cases() {
  std::vector<Case> out;
  for (const Case& c : cases()) {
    if (!c.batch_invariant) out.push_back(c);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Stream, RaggedDotTest,
                         ::testing::Combine(::testing::ValuesIn(stream_cases()),
                                            ::testing::Values(RaggedDotImpl::kCpuStream)),
                         [](const auto& info) {
                           return std::get<0>(info.param).name +
                                  impl_suffix(std::get<1>(info.param));
                         });

// One kCpuStream check against the reference: `run(x, w, impl)` gives a call's f32 output; the
// reference on the operands' magnitudes bounds each element's f32 accumulation error over a
// contraction of kc (its magnitude: elements no call writes, as rows' padding, keep whatever the
// output held). Returns a function of the output under test that asserts each element.
template <typename Run>
auto StreamChecker(Run run, HostTensor& a, HostTensor& w, int64_t kc) {
  HostTensor a_abs = a, w_abs = w;
  for (int64_t i = 0; i < a.span(); ++i) a_abs.set_flat(i, std::abs(a.get_flat(i)));
  for (int64_t i = 0; i < w.span(); ++i) w_abs.set_flat(i, std::abs(w.get_flat(i)));
  return [want = run(a, w, RaggedDotImpl::kReference),
          bound = run(a_abs, w_abs, RaggedDotImpl::kReference), kc](const HostTensor& got) {
    for (int64_t i = 0; i < got.span(); ++i) {
      ASSERT_NEAR(got.get_flat(i), want.get_flat(i),
                  (kc + 4) * 1.2e-7 * std::abs(bound.get_flat(i)))
          << "element " << i;
    }
  };
}

// StreamChecker's `run` for a call of m rows into a fresh f32 [m, cols]: ragged_dot of x against
// y over `groups` (their sizes must outlive it), or with dlhs ragged_dot_dlhs, rhs_transposed as
// given.
auto f32_run(RaggedDotGroups groups, int64_t m, int64_t cols, bool dlhs, bool transposed = false) {
  return [=](HostTensor& x, HostTensor& y, RaggedDotImpl impl) {
    RaggedDotOptions o;
    o.impl = impl, o.rhs_transposed = transposed;
    HostTensor out(DType::kF32, {m, cols});
    const Status st = dlhs ? ragged_dot_dlhs(x.in(), y.in(), groups, out.mut(), o)
                           : ragged_dot(x.in(), y.in(), groups, out.mut(), o);
    EXPECT_TRUE(st.ok()) << st.message();
    return out;
  };
}

// kCpuStream on every Highway target this CPU runs (the bf16-pair kernel needs AVX512-BF16 and
// an AVX-512 target; the others take the f32 kernel, bf16 widened), against the reference: each
// element within f32 accumulation error of the reference's, the error bound taken from the
// reference run on the operands' magnitudes.
// Group sizes reach each kernel's chunks: 1, 3 and 5 rows (4-vector panels on AVX-512; 5 takes
// the 2-vector f32 panels on AVX2), 11 and 12 (one chunk of 2-vector panels: the pair kernel's
// largest, the f32 kernel's on AVX-512), 17 and 64 (several chunks), an empty group. n = 700:
// the 64-row group's sums (175 KiB) go in 3 slabs of 64 KiB at most, the last partial.
TEST(RaggedDotStream, EveryTargetAgainstTheReference) {
  const int64_t K = 131, n = 700, G = 8;
  const std::vector<int32_t> sizes{3, 0, 64, 1, 17, 5, 11, 12};
  const int64_t m = 120;
  std::mt19937 rng(5);
  for (DType in : {DType::kF32, DType::kBF16}) {
    for (bool transposed : {false, true}) {
      for (bool dlhs : {false, true}) {
        SCOPED_TRACE(fmt::format("{} transposed={} dlhs={}", dtype_name(in), transposed, dlhs));
        const int64_t kc = dlhs ? n : K, cols = dlhs ? K : n;
        HostTensor a(in, {m, kc}),
            w(in, transposed ? std::vector<int64_t>{G, n, K} : std::vector<int64_t>{G, K, n});
        a.fill_random(rng);
        w.fill_random(rng);
        const auto run = f32_run(sizes, m, cols, dlhs, transposed);
        const auto check = StreamChecker(run, a, w, kc);
        const auto targets = hwy::SupportedAndGeneratedTargets();
        ASSERT_GE(targets.size(), 2u);
        detail::set_amx_for_test(false);  // the Highway kernels, on a CPU with AMX too
        for (const int64_t target : targets) {
          SCOPED_TRACE(hwy::TargetName(target));
          hwy::SetSupportedTargetsForTest(target);
          check(run(a, w, RaggedDotImpl::kCpuStream));
          if (::testing::Test::HasFatalFailure()) break;
        }
        hwy::SetSupportedTargetsForTest(0);  // back to what the CPU supports
        detail::set_amx_for_test(true);
        if (::testing::Test::HasFatalFailure()) return;
        SCOPED_TRACE("AMX where the CPU has it");
        check(run(a, w, RaggedDotImpl::kCpuStream));
      }
    }
  }
}

// kAuto takes kCpuStream where every local group has at most `bound` rows, oneDNN where one has
// more: RaggedDotOptions::ran names it and its result is the bytes of the implementation named.
// `pass` runs one call on groups {3, rows, 0, 9} of K x n data (`dtype`; the output f32) with the
// implementation given, sets *ran, and returns its output bytes. A bound of -1: no bound (a group
// of 1000 rows still takes kCpuStream).
template <typename Pass>
void ExpectAutoPicksByTheLargestLocalGroup(int64_t K, int64_t n, int32_t bound, Pass pass,
                                           DType dtype = DType::kF32) {
  std::mt19937 rng(11);
  const std::vector<int32_t> cases =
      bound < 0 ? std::vector<int32_t>{1000} : std::vector<int32_t>{bound, bound + 1};
  for (const int32_t rows : cases) {
    const std::vector<int32_t> sizes{3, rows, 0, 9};
    const int64_t m = 3 + rows + 9;
    HostTensor in(dtype, {m, pass.in_cols(K, n)}), w(dtype, {4, K, n});
    in.fill_random(rng);
    w.fill_random(rng);
    const RaggedDotImpl want =
        bound < 0 || rows <= bound ? RaggedDotImpl::kCpuStream : RaggedDotImpl::kOneDnn;
    RaggedDotImpl ran = RaggedDotImpl::kAuto, named = RaggedDotImpl::kAuto;
    EXPECT_TRUE(pass(in, w, sizes, RaggedDotImpl::kAuto, &ran) == pass(in, w, sizes, want, &named))
        << "largest group " << rows;
    EXPECT_STREQ(impl_name(ran), impl_name(want)) << "largest group " << rows;
  }
}

// One call of a pass with the implementation given: its output's bytes.
struct DlhsPass {
  int64_t in_cols(int64_t, int64_t n) const { return n; }
  auto operator()(HostTensor& d_out, HostTensor& w, const std::vector<int32_t>& sizes,
                  RaggedDotImpl impl, RaggedDotImpl* ran) const {
    RaggedDotOptions o;
    o.impl = impl, o.ran = ran;
    HostTensor d_lhs(DType::kF32, {d_out.shape[0], w.shape[1]});
    EXPECT_TRUE(ragged_dot_dlhs(d_out.in(), w.in(), sizes, d_lhs.mut(), o).ok());
    return d_lhs.bytes;
  }
};
struct FwdPass {
  int64_t in_cols(int64_t K, int64_t) const { return K; }
  auto operator()(HostTensor& x, HostTensor& w, const std::vector<int32_t>& sizes,
                  RaggedDotImpl impl, RaggedDotImpl* ran) const {
    RaggedDotOptions o;
    o.impl = impl, o.ran = ran;
    HostTensor out(DType::kF32, {x.shape[0], w.shape[2]});
    EXPECT_TRUE(ragged_dot(x.in(), w.in(), sizes, out.mut(), o).ok());
    return out.bytes;
  }
};

// The CPU runs the bf16-pair kernels; the CPU has AVX2 and no AVX-512 (bf16 runs the f32 kernels
// with their operands widened once).
bool has_bf16_pairs() {
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512f");
}
bool avx2_only() { return __builtin_cpu_supports("avx2") && !__builtin_cpu_supports("avx512f"); }
// The CPU has AMX-BF16 and AMX-TILE (CPUID.(7,0):EDX bits 22, 24) and Linux grants the tiles
// (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, 18): then the AMX kernels must take bf16 calls.
bool cpu_has_amx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) != 0 && (d & (1u << 22)) != 0 &&
         (d & (1u << 24)) != 0 && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

// oneDNN's matmuls run on AMX (the bounds measured on an Intel Xeon with AMX).
bool amx() { return detail::onednn_runs_amx(); }

// The f32 input gradient (dot products): the bound is 160 rows, 32 on AVX2.
TEST(RaggedDotStream, AutoPicksByTheLargestLocalGroup) {
  ExpectAutoPicksByTheLargestLocalGroup(40, 72, avx2_only() ? 32 : 160, DlhsPass{});
}

// The f32 forward against [K, n] weights (the output-contiguous f32 kernel): 48 rows, 40 on AVX2,
// 64 where oneDNN runs AMX.
// (K = 1000: with a short contraction both implementations can give the same bits, and the test
// could not fail.)
TEST(RaggedDotStream, AutoPicksByTheLargestLocalGroupF32Forward) {
  ExpectAutoPicksByTheLargestLocalGroup(1000, 72, avx2_only() ? 40 : amx() ? 64 : 48, FwdPass{});
}

// The bf16 forward against [K, n] weights: with AMX no bound (the AMX kernel); with AVX512-BF16
// the pair kernel's 256 rows (24 where oneDNN runs AMX), whatever the bytes of a weight row
// (narrow, 2 KiB and wide, past the items' 4 KiB spans and 64 KiB sums); on AVX2 256 too;
// otherwise the f32 kernel's 12.
TEST(RaggedDotStream, AutoPicksByTheLargestLocalGroupBf16Forward) {
  const int32_t most = cpu_has_amx()      ? -1
                       : has_bf16_pairs() ? (amx() ? 24 : 256)
                       : avx2_only()      ? 256
                                          : 12;
  for (const int64_t n : {72, 1024, 4200}) {
    SCOPED_TRACE(fmt::format("n = {} ({} bytes a weight row)", n, 2 * n));
    ExpectAutoPicksByTheLargestLocalGroup(1000, n, most, FwdPass{}, DType::kBF16);
  }
}

// The bf16 input gradient against [K, n] weights: with AMX no bound (the AMX kernel); with
// AVX512-BF16 256 rows, through the dot products (a contraction of up to 4 KiB) or past 32 rows the
// transposed pairs (longer), and 24 where oneDNN runs AMX; on AVX2 384; otherwise the f32 dot
// products' 160.
TEST(RaggedDotStream, AutoPicksByTheLargestLocalGroupBf16InputGradient) {
  const int32_t most = cpu_has_amx()      ? -1
                       : has_bf16_pairs() ? (amx() ? 24 : 256)
                       : avx2_only()      ? 384
                                          : 160;
  for (const int64_t n : {1000, 2050}) {
    SCOPED_TRACE(fmt::format("n = {} ({} bytes a weight row)", n, 2 * n));
    ExpectAutoPicksByTheLargestLocalGroup(72, n, most, DlhsPass{}, DType::kBF16);
  }
}

// The contraction-contiguous form's transposed pairs (the bf16-pair kernels, groups of more than
// 32 rows, a contraction past 4 KiB): the input gradient against [K, n] weights and the forward
// against [n, K] ones, an odd contraction, 300 outputs (slabs of whole 64-column panels and a
// partial one), groups of 33 and 70 rows beside one the dot products take and an empty one,
// against the reference within f32 accumulation error.
TEST(RaggedDotStream, TransposedPairsAgainstTheReference) {
  const int64_t kc = 2101, cols = 300, G = 4;
  const std::vector<int32_t> sizes{33, 0, 70, 5};
  const int64_t m = 108;
  std::mt19937 rng(8);
  for (bool dlhs : {true, false}) {
    SCOPED_TRACE(dlhs ? "input gradient, [K, n] weights" : "forward, [n, K] weights");
    HostTensor a(DType::kBF16, {m, kc}), w(DType::kBF16, {G, cols, kc});
    a.fill_random(rng);
    w.fill_random(rng);
    const auto run = f32_run(sizes, m, cols, dlhs, !dlhs);
    StreamChecker(run, a, w, kc)(run(a, w, RaggedDotImpl::kCpuStream));
  }
}

// The dot-product kernels' shapes (the input gradient against [K, n] weights). bf16 pairs: up to 8
// rows one chunk against 1 weight row, up to 16 two chunks against 2, more chunks of 6 against 4;
// f32 on AVX-512: up to 4 rows against 1, up to 8 against 2, more chunks of 6 against 4; on AVX2
// (f32, and bf16 through DotSplit): up to 2 rows against 4, more chunks of 6 against 2. Groups at
// each edge (2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17 rows), one row, empty groups; one group holding
// every row (13: two chunks); a shard (group_offset 1, 2 local groups of 9 and 16 rows, rows
// outside them before and after); 131 outputs (the last call of 2 and of 4 weight rows moves back
// over summed columns); a contraction of 700 (one span; not a multiple of DotSplit's 16) and of
// 2101 (on AVX-512 two or three spans, their sums added, where a group has more than one chunk; on
// AVX2 whole rows: a wrong step there fails this test). Against the reference within f32
// accumulation error.
TEST(RaggedDotStream, DotShapesAgainstTheReference) {
  struct Problem {
    std::vector<int32_t> sizes;
    int32_t offset;
    int64_t local, m;
  };
  const std::vector<Problem> problems{{{8, 9, 0, 16, 17, 1, 4, 5}, 0, 8, 60},
                                      {{2, 6, 0, 7, 12}, 0, 5, 27},
                                      {{13}, 0, 1, 13},
                                      {{3, 9, 16, 0}, 1, 2, 30}};
  const int64_t K = 131;
  std::mt19937 rng(12);
  for (const Problem& p : problems) {
    for (DType dtype : {DType::kBF16, DType::kF32}) {
      for (const int64_t kc : {700, 2101}) {
        SCOPED_TRACE(fmt::format("{} rows in groups of {}, offset {}; {}, contraction {}", p.m,
                                 fmt::join(p.sizes, "/"), p.offset, dtype_name(dtype), kc));
        HostTensor d_out(dtype, {p.m, kc}), w(dtype, {p.local, K, kc});
        d_out.fill_random(rng);
        w.fill_random(rng);
        const auto run = f32_run({p.sizes, p.offset}, p.m, K, /*dlhs=*/true);
        StreamChecker(run, d_out, w, kc)(run(d_out, w, RaggedDotImpl::kCpuStream));
      }
    }
  }
}

// The dot products' chunks stay in L1 while their bytes take at most three quarters of it (32 KiB
// where the machine does not say).
TEST(RaggedDotStream, DotChunkFitsL1Rule) {
  constexpr int64_t kEpyc = 32 << 10, kXeon = 48 << 10;
  EXPECT_TRUE(detail::dot_chunk_fits_l1(3 * 8192, kEpyc));  // deepseek-v3's f32 rows, 3 of them
  EXPECT_FALSE(detail::dot_chunk_fits_l1(4 * 8192, kEpyc));
  EXPECT_TRUE(detail::dot_chunk_fits_l1(24 << 10, kEpyc));  // the boundary
  EXPECT_FALSE(detail::dot_chunk_fits_l1((24 << 10) + 1, kEpyc));
  EXPECT_TRUE(detail::dot_chunk_fits_l1(4 * 8192, kXeon));
  EXPECT_FALSE(detail::dot_chunk_fits_l1((36 << 10) + 1, kXeon));
  EXPECT_TRUE(detail::dot_chunk_fits_l1(24 << 10, 0));
  EXPECT_FALSE(detail::dot_chunk_fits_l1((24 << 10) + 1, 0));
}

// kCpuStream's input gradient (the dot products) on a contraction of 12289 (bf16 rows of 24 KiB,
// f32 of 48 KiB): from 2 bf16 rows and 1 f32 row a chunk's rows take more than three quarters of
// an L1 of up to 64 KiB, so on AVX-512 groups of 1-8 rows (and 14 and 16: two chunks of 7-8 on
// spans) run as chunks of 6 against 4 weight rows, 1-5 rows of them in one chunk of whole rows
// (the pair kernels' 1-4 rows against 4 weight rows nowhere else); 37 outputs (the last call of
// 4 weight rows moves back), a shard (group_offset 1), and one group holding every row: 8 rows
// (bf16: two chunks of 4 on spans) and 3 (one chunk of whole rows). Against the reference within
// f32 accumulation error.
TEST(RaggedDotStream, DotShapesPastL1AgainstTheReference) {
  struct Problem {
    std::vector<int32_t> sizes;
    int32_t offset;
    int64_t local, m;
  };
  const std::vector<Problem> problems{{{1, 2, 3, 4, 0, 5, 6, 7, 8}, 0, 9, 36},
                                      {{2, 14, 16, 1}, 1, 2, 33},
                                      {{8}, 0, 1, 8},
                                      {{3}, 0, 1, 3}};
  const int64_t K = 37, kc = 12289;
  std::mt19937 rng(43);
  for (const Problem& p : problems) {
    for (DType dtype : {DType::kBF16, DType::kF32}) {
      SCOPED_TRACE(fmt::format("{} rows in groups of {}, offset {}; {}", p.m,
                               fmt::join(p.sizes, "/"), p.offset, dtype_name(dtype)));
      HostTensor d_out(dtype, {p.m, kc}), w(dtype, {p.local, K, kc});
      d_out.fill_random(rng);
      w.fill_random(rng);
      const auto run = f32_run({p.sizes, p.offset}, p.m, K, /*dlhs=*/true);
      StreamChecker(run, d_out, w, kc)(run(d_out, w, RaggedDotImpl::kCpuStream));
    }
  }
}

// kCpuStream's output-contiguous form on random operands of `dtype`, groups of `sizes` rows against
// [K, n] weights: the forward, and the input gradient against the same tensor read as transposed
// weights ([n, K]), each against the reference within f32 accumulation error (StreamChecker).
void CheckOutputContiguous(const std::vector<int32_t>& sizes, int64_t K, int64_t n, DType dtype,
                           std::mt19937& rng) {
  const auto G = static_cast<int64_t>(sizes.size());
  const int64_t m = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  for (bool dlhs : {false, true}) {
    SCOPED_TRACE(fmt::format("{} rows in groups of {}; {}, {} columns, {}", m,
                             fmt::join(sizes, "/"), dtype_name(dtype), n,
                             dlhs ? "input gradient" : "forward"));
    HostTensor a(dtype, {m, K}), w(dtype, {G, K, n});
    a.fill_random(rng);
    w.fill_random(rng);
    const auto run = f32_run(sizes, m, n, dlhs, dlhs);
    StreamChecker(run, a, w, K)(run(a, w, RaggedDotImpl::kCpuStream));
  }
}

// kCpuStream's output-contiguous form (the forward against [K, n] weights, and the input gradient
// against transposed ones: the same tensor read as [n, K]), groups of several chunks of rows on
// weight rows past 4 KiB: on AVX2
// (stream::kWholeRowBytes) rows of up to 6 KiB whole, longer ones in slabs of at most 4 KiB; on
// AVX-512 slabs past 4 KiB. bf16 rows of 2880 columns (5.6 KiB: whole on AVX2) and 3300 (6.4 KiB:
// 2 slabs, the last panel partial), f32 rows of 1408 (5.5 KiB) and 2880 (11.3 KiB: 3 slabs);
// groups of 7-12 rows (two chunks), 20 and 40 (past kSumsRows: slabs for the sums as well), 1-3
// rows, none; 15 with rows, so that up to 3 threads have 4 items each without slabs to balance
// them. Against the reference within f32 accumulation error.
TEST(RaggedDotStream, WholeRowsAndSlabsAgainstTheReference) {
  std::mt19937 rng(21);
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    for (const int64_t n : dtype == DType::kBF16 ? std::vector<int64_t>{2880, 3300}
                                                 : std::vector<int64_t>{1408, 2880}) {
      CheckOutputContiguous({8, 0, 20, 1, 40, 7, 9, 8, 3, 8, 12, 8, 2, 8, 10, 8}, 70, n, dtype,
                            rng);
    }
  }
}

// kCpuStream's output-contiguous form, groups whose chunks of 3-4 rows run on panels of 3 vectors,
// then of 1, then a zero-padded one (below AVX-512, on bf16): 7 and 8 rows (two such chunks), 9,
// 15 and 33 (chunks of 6 and one of 3), beside 2 and 10 rows (other chunks) and an empty group;
// and one group of 15 holding every row (its columns in slabs for the threads); column counts that
// leave every kind of tail (none, 1 or 2 vectors, and 1-7 columns past them); the forward and the
// input gradient against transposed weights, bf16 and f32. Against the reference within f32
// accumulation error.
TEST(RaggedDotStream, ThreeVectorChunksEveryColumnTailAgainstTheReference) {
  std::mt19937 rng(23);
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    for (const int64_t n : {1, 5, 8, 13, 24, 31, 47, 53, 72}) {
      CheckOutputContiguous({7, 8, 0, 9, 15, 2, 33, 10}, 37, n, dtype, rng);
      CheckOutputContiguous({0, 15, 0}, 37, n, dtype, rng);
    }
  }
}

// kCpuStream's output-contiguous form with one chunk of rows a group, on rows whose blocks
// one_chunk_block_rows makes longer than 8 where L1d is 48 KiB (1.5 KiB bf16 rows: 16; 768 B: 32)
// and 8 where it is 32 KiB: contractions of whole blocks and a partial one (87 = 5 x 16 + 7, 75),
// groups of 0-5 rows, bf16 and f32 (whose 3 KiB rows keep 8). (The pair kernels' groups of 3-5
// rows take blocks of 128 KiB: OneChunkLongBlocksAgainstTheReference.) Against the reference.
TEST(RaggedDotStream, OneChunkBlocksOfEveryLengthAgainstTheReference) {
  std::mt19937 rng(29);
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    CheckOutputContiguous({1, 3, 0, 5, 2}, 87, 768, dtype, rng);
    CheckOutputContiguous({2, 0, 4, 1}, 75, 384, dtype, rng);
  }
}

// kCpuStream's output-contiguous form, one chunk of rows a group, the pair kernels' blocks of
// 1-2 rows (L1-sized: 8 of 1536-byte rows where L1d is 32 KiB, 16 where 48) beside those of 3-11
// rows (about 128 KiB: 85 rows, 86 with whole pairs): a contraction of two such blocks and an odd
// part (181 = 2 x 86 + 9), groups of 1-11 rows in turn, so that each item prefetches a next one
// with other blocks; one group holding every row, alone and between empty groups (fewer groups
// than threads: parts of the contraction, each of long blocks and a part of one); rows of 26
// bytes (one block). bf16 (the pair kernels where the CPU has AVX512-BF16) and f32. Against the
// reference.
TEST(RaggedDotStream, OneChunkLongBlocksAgainstTheReference) {
  std::mt19937 rng(37);
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    CheckOutputContiguous({3, 1, 0, 6, 2, 11, 4, 1, 5}, 181, 768, dtype, rng);
    CheckOutputContiguous({7}, 181, 768, dtype, rng);
    CheckOutputContiguous({0, 3, 0}, 301, 768, dtype, rng);
    CheckOutputContiguous({4, 2, 9}, 181, 13, dtype, rng);
  }
}

// kCpuStream's output-contiguous form on bf16, one chunk of rows a group, with each of its two
// kernels on a CPU with AVX512-BF16 (the even/odd kernels, which a CPU with AMX takes, and the
// pair kernels, which the others take; set_even_odd_for_test forces each; AMX kept off, as it
// would take groups of 8 rows): groups of 0-11 rows (panels of 4 vectors to 5 rows, of 2 past
// them), column counts that leave every tail of a panel (1, 13, 31, 47, 72) and many panels
// (700), an odd contraction; the forward and the input gradient against transposed weights.
// Against the reference within f32 accumulation error. (Without AVX512-BF16 both settings run
// the f32 kernels.)
TEST(RaggedDotStream, OneChunkEvenOddAndPairKernelsAgainstTheReference) {
  std::mt19937 rng(31);
  detail::set_amx_for_test(false);
  for (const int mode : {1, 0}) {
    SCOPED_TRACE(mode == 1 ? "even/odd kernels" : "pair kernels");
    detail::set_even_odd_for_test(mode);
    for (const int64_t n : {1, 13, 31, 47, 72, 700}) {
      CheckOutputContiguous({1, 0, 5, 11, 2, 6, 3, 9}, 45, n, DType::kBF16, rng);
      CheckOutputContiguous({4, 7, 10, 8}, 64, n, DType::kBF16, rng);
    }
  }
  detail::set_even_odd_for_test(-1);
  detail::set_amx_for_test(true);
}

// kCpuStream's forward, groups of one chunk of rows: whole, unless the groups are fewer than the
// threads (then parts of the contraction, enough for every thread, of 64 rows at least) or the
// threads do not divide their count (then column slabs to even them, never in runs of a weight
// row shorter than 8 KiB).
TEST(RaggedDotStream, OneChunkSplit) {
  auto split = [](int64_t busy, int64_t threads, int64_t row_bytes, int64_t kc) {
    const detail::OneChunkSplit s = detail::one_chunk_split(busy, threads, row_bytes, kc);
    return std::pair(s.slabs, s.parts);
  };
  using P = std::pair<int64_t, int64_t>;
  // Every thread has a group: whole, however long the rows.
  EXPECT_EQ(split(2, 2, 1 << 20, 4096), P(1, 1));
  EXPECT_EQ(split(6, 2, 2816, 2048), P(1, 1));
  EXPECT_EQ(split(8, 4, 1 << 20, 4096), P(1, 1));
  // Fewer groups than threads: parts for every thread, of 64 contraction rows at least.
  EXPECT_EQ(split(1, 2, 2816, 2048), P(1, 2));
  EXPECT_EQ(split(1, 2, 2816, 128), P(1, 2));
  EXPECT_EQ(split(1, 2, 2816, 127), P(1, 1));
  EXPECT_EQ(split(1, 4, 2816, 2048), P(1, 4));
  EXPECT_EQ(split(1, 4, 2816, 192), P(1, 3));
  EXPECT_EQ(split(3, 4, 2816, 2048), P(1, 2));
  // An uneven count: slabs to even it where the runs keep 8 KiB.
  EXPECT_EQ(split(3, 2, 16383, 2048), P(1, 1));
  EXPECT_EQ(split(3, 2, 16384, 2048), P(2, 1));
  EXPECT_EQ(split(6, 4, 1 << 20, 2048), P(2, 1));
  EXPECT_EQ(split(5, 4, 1 << 20, 2048), P(4, 1));
  // One thread, or no group with rows.
  EXPECT_EQ(split(3, 1, 1 << 20, 2048), P(1, 1));
  EXPECT_EQ(split(0, 2, 1 << 20, 2048), P(1, 1));
}

// The blocks of weight rows with one chunk of rows: 8 rows, or a multiple of 8 filling at most half
// of L1d; 8 where the machine does not say.
TEST(RaggedDotStream, OneChunkBlocksFillHalfOfL1) {
  constexpr int64_t kXeon = 48 << 10, kEpyc = 32 << 10;
  EXPECT_EQ(detail::one_chunk_block_rows(1536, kXeon), 16);  // qwen3-30b-a3b's ffn, bf16
  EXPECT_EQ(detail::one_chunk_block_rows(1536, kEpyc), 8);
  EXPECT_EQ(detail::one_chunk_block_rows(3072, kXeon), 8);  // 8 rows fill half already
  EXPECT_EQ(detail::one_chunk_block_rows(4096, kXeon), 8);  // (and past it: never fewer)
  EXPECT_EQ(detail::one_chunk_block_rows(1024, kXeon), 24);
  EXPECT_EQ(detail::one_chunk_block_rows(1536, 0), 8);
}

// The pair kernels' one-chunk blocks: as one_chunk_block_rows for 1-2 rows; from 3 rows on, twice
// that past 5 rows and at least 128 KiB of rows.
TEST(RaggedDotStream, OneChunkPairBlocks) {
  constexpr int64_t kXeon = 48 << 10, kEpyc = 32 << 10;
  EXPECT_EQ(detail::one_chunk_pair_block_rows(1, 1536, kEpyc), 8);  // qwen3-30b-a3b's ffn
  EXPECT_EQ(detail::one_chunk_pair_block_rows(2, 1536, kEpyc), 8);
  EXPECT_EQ(detail::one_chunk_pair_block_rows(2, 1536, kXeon), 16);
  EXPECT_EQ(detail::one_chunk_pair_block_rows(3, 1536, kEpyc), 85);  // 128 KiB
  EXPECT_EQ(detail::one_chunk_pair_block_rows(11, 1536, kXeon), 85);
  EXPECT_EQ(detail::one_chunk_pair_block_rows(3, 4096, kEpyc), 32);  // deepseek-v3's
  EXPECT_EQ(detail::one_chunk_pair_block_rows(5, 32768, kEpyc), 8);  // mixtral-8x7b's slabs
  EXPECT_EQ(detail::one_chunk_pair_block_rows(6, 32768, kEpyc), 16);
  EXPECT_EQ(detail::one_chunk_pair_block_rows(3, 1536, 0), 85);
}

// The f32 kernels' groups of 1-2 rows whose sums take at most 6 KiB run row-major.
TEST(RaggedDotStream, OneChunkRowMajorRule) {
  EXPECT_TRUE(detail::one_chunk_row_major(1, 768));  // qwen3-30b-a3b's ffn: 3 KiB of sums
  EXPECT_TRUE(detail::one_chunk_row_major(2, 768));  // 6 KiB: the boundary
  EXPECT_FALSE(detail::one_chunk_row_major(2, 769));
  EXPECT_TRUE(detail::one_chunk_row_major(1, 1536));
  EXPECT_FALSE(detail::one_chunk_row_major(1, 1537));
  EXPECT_FALSE(detail::one_chunk_row_major(1, 2048));  // deepseek-v3's: 8 KiB
  EXPECT_FALSE(detail::one_chunk_row_major(3, 13));    // 3 rows: the panels
  EXPECT_FALSE(detail::one_chunk_row_major(0, 13));
  EXPECT_TRUE(detail::one_chunk_row_major(1, 1));
}

// kCpuStream's output-contiguous form on f32, groups of 1-2 rows row-major (on AVX-512; below it
// the panels) beside groups of 0 and 3 rows (the panels): column counts with every tail of a
// vector (1, 13, 17, 31) and each side of the 6 KiB boundary (768 at 2 rows, 1536 at 1, and 1537
// past it); a contraction of several blocks and a partial one (45), and one of 301 with a lone
// group of 2 rows between empty ones and one group of 1 row holding every row (parts of the
// contraction); the forward and the input
// gradient against transposed weights. Against the reference within f32 accumulation error.
TEST(RaggedDotStream, OneChunkRowMajorAgainstTheReference) {
  std::mt19937 rng(41);
  for (const int64_t n : {1, 13, 17, 31, 768, 1536, 1537}) {
    CheckOutputContiguous({1, 2, 0, 1, 3, 2}, 45, n, DType::kF32, rng);
    CheckOutputContiguous({0, 2, 0}, 301, n, DType::kF32, rng);
    CheckOutputContiguous({1}, 301, n, DType::kF32, rng);
  }
}

// Blocks prefetched into L1 only where two of them fit there (the one at hand and the next);
// 32 KiB where the machine does not say.
TEST(RaggedDotStream, PrefetchIntoL1WhereTwoBlocksFit) {
  constexpr int64_t kXeon = 48 << 10, kEpyc = 32 << 10;
  EXPECT_TRUE(detail::prefetch_into_l1(8 * 1536, kEpyc));    // qwen3-30b-a3b's, 1-5 rows
  EXPECT_FALSE(detail::prefetch_into_l1(16 * 1536, kEpyc));  // its blocks at 6-11 rows
  EXPECT_TRUE(detail::prefetch_into_l1(16 * 1536, kXeon));
  EXPECT_FALSE(detail::prefetch_into_l1(8 * 4096, kEpyc));  // deepseek-v3's, 4 KiB rows
  EXPECT_TRUE(detail::prefetch_into_l1(16 << 10, kEpyc));   // the boundary: exactly twice
  EXPECT_FALSE(detail::prefetch_into_l1((16 << 10) + 64, kEpyc));
  EXPECT_FALSE(detail::prefetch_into_l1(128 << 10, kXeon));  // kBlockBytes
  EXPECT_TRUE(detail::prefetch_into_l1(16 << 10, 0));        // unknown L1: 32 KiB
  EXPECT_FALSE(detail::prefetch_into_l1(24 << 10, -1));
}

// The slabs of bf16 weight rows past 32 KiB in groups of one chunk: their f32 sums take a quarter
// of a core's L2 at most, within [128 KiB, 1 MiB]; 128 KiB where the machine does not say.
TEST(RaggedDotStream, WideSumsBudgetIsAQuarterOfL2) {
  EXPECT_EQ(detail::wide_sums_budget(int64_t{512} << 10), int64_t{128} << 10);  // AMD EPYC Zen 2
  EXPECT_EQ(detail::wide_sums_budget(int64_t{1} << 20), int64_t{256} << 10);
  EXPECT_EQ(detail::wide_sums_budget(int64_t{2} << 20), int64_t{512} << 10);  // this Xeon
  EXPECT_EQ(detail::wide_sums_budget(int64_t{4} << 20), int64_t{1} << 20);
  EXPECT_EQ(detail::wide_sums_budget(int64_t{64} << 20), int64_t{1} << 20);     // at most 1 MiB
  EXPECT_EQ(detail::wide_sums_budget(int64_t{256} << 10), int64_t{128} << 10);  // at least 128 KiB
  EXPECT_EQ(detail::wide_sums_budget(0), int64_t{128} << 10);
  EXPECT_EQ(detail::wide_sums_budget(-1), int64_t{128} << 10);  // sysconf's "unknown"
}

// The forward's one-chunk groups split, against the reference: on two threads one group of 3 rows
// (in two parts of the contraction; an odd contraction, so the second part ends on a lone row)
// and 3 groups of 1, 2 and 1 rows of 16400 bytes or more beside an empty one (in 2 column slabs
// each); on four threads 3 groups (two parts each: six parts on four threads) and a lone group
// between empty ones (four parts); a shard (group_offset 1) whose one local group, or one busy
// local group beside an empty one, goes in parts, the rows padded (row strides past the widths)
// and the rows outside the shard zeroed or kept. Each with bf16 and f32 operands, the output f32,
// and of the operands' dtype added to what it held (the parts' sum and the held value rounded
// once).
TEST(RaggedDotStream, OneChunkSplitAgainstTheReference) {
  // The wide rows' slabs at the 128 KiB of sums the shapes below were cut for, whatever this
  // machine's L2 makes of them (wide_sums_budget).
  struct WideSums {
    WideSums() { detail::set_stream_wide_sums_for_test(int64_t{128} << 10); }
    ~WideSums() { detail::set_stream_wide_sums_for_test(0); }
  } const wide_sums;
  const int before = omp_get_max_threads();
  std::mt19937 rng(12);
  struct Shape {
    int threads;
    int64_t n;
    std::vector<int32_t> sizes;
    int32_t offset = 0;
    int64_t e_loc = 0;  // 0: every group
    int64_t pad = 0;    // elements past each row of x and the output
  };
  const Shape shapes[] = {{2, 4160, {3}},
                          {2, 8200, {1, 0, 2, 1}},
                          {4, 700, {2, 3, 1}},
                          {4, 300, {0, 5, 0}},
                          {2, 600, {4, 3, 2}, 1, 1, 5},
                          {2, 600, {4, 0, 2, 1}, 1, 2, 3},
                          // bf16 rows past 32 KiB: slabs of 128 KiB of sums (2 and 3 here), with
                          // the parts of a lone group, on a shard with padded rows, and an odd
                          // width (the last slab's last panel partial).
                          {2, 16448, {3, 0, 2}},
                          {2, 16448, {5}},
                          {2, 16448, {2, 5, 0}, 1, 2, 7},
                          {2, 16451, {4, 1}}};
  // bf16 with each one-chunk kernel of an AVX512-BF16 CPU (the even/odd kernels, then the pair
  // kernels: set_even_odd_for_test), f32 once.
  struct Kernels {
    ~Kernels() { detail::set_even_odd_for_test(-1); }
  } const kernels;
  const std::pair<DType, int> runs[] = {{DType::kBF16, 1}, {DType::kBF16, 0}, {DType::kF32, -1}};
  for (const auto& [in, even_odd] : runs) {
    detail::set_even_odd_for_test(even_odd);
    for (const Shape& sh : shapes) {
      for (bool accumulate : {false, true}) {
        SCOPED_TRACE(fmt::format(
            "{} (even/odd {}) threads {} n {} groups {} offset {} accumulate {}", dtype_name(in),
            even_odd, sh.threads, sh.n, sh.sizes.size(), sh.offset, accumulate));
        omp_set_num_threads(sh.threads);
        const int64_t K = 263;
        const int64_t E_loc = sh.e_loc > 0 ? sh.e_loc : static_cast<int64_t>(sh.sizes.size());
        int64_t m = 0;
        for (int32_t s : sh.sizes) m += s;
        HostTensor a(in, {m, K}, sh.pad), w(in, {E_loc, K, sh.n}),
            held(DType::kF32, {m, sh.n}, sh.pad);
        a.fill_random(rng);
        w.fill_random(rng);
        held.fill_random(rng);
        const DType out_type = accumulate ? in : DType::kF32;
        HostTensor held_out(out_type, {m, sh.n}, sh.pad);
        for (int64_t i = 0; i < held.span(); ++i) held_out.set_flat(i, held.get_flat(i));
        auto run = [&](HostTensor& x, HostTensor& y, RaggedDotImpl impl) {
          RaggedDotOptions o;
          o.impl = impl, o.accumulate = accumulate;
          HostTensor out = held_out;
          const Status st =
              ragged_dot(x.in(), y.in(), RaggedDotGroups(sh.sizes, sh.offset), out.mut(), o);
          EXPECT_TRUE(st.ok()) << st.message();
          HostTensor f32(DType::kF32, {m, sh.n}, sh.pad);
          for (int64_t i = 0; i < f32.span(); ++i) f32.set_flat(i, out.get_flat(i));
          return f32;
        };
        if (!accumulate) {
          StreamChecker(run, a, w, K)(run(a, w, RaggedDotImpl::kCpuStream));
        } else {
          // The held values added (bf16 or f32): within the f32 accumulation error (the
          // reference on the operands' magnitudes bounds it) and one bf16 rounding of the
          // reference's.
          HostTensor a_abs = a, w_abs = w;
          for (int64_t i = 0; i < a.span(); ++i) a_abs.set_flat(i, std::abs(a.get_flat(i)));
          for (int64_t i = 0; i < w.span(); ++i) w_abs.set_flat(i, std::abs(w.get_flat(i)));
          held_out.fill(0.f);
          const HostTensor bound = run(a_abs, w_abs, RaggedDotImpl::kReference);
          for (int64_t i = 0; i < held.span(); ++i) held_out.set_flat(i, held.get_flat(i));
          const HostTensor want = run(a, w, RaggedDotImpl::kReference),
                           got = run(a, w, RaggedDotImpl::kCpuStream);
          for (int64_t i = 0; i < got.span(); ++i) {
            ASSERT_NEAR(
                got.get_flat(i), want.get_flat(i),
                (K + 4) * 1.2e-7 * (bound.get_flat(i) + 1) + std::abs(want.get_flat(i)) / 128)
                << "element " << i;
          }
        }
      }
    }
  }
  omp_set_num_threads(before);
}

// The AMX kernels (ragged_dot_amx.cpp) at their edges, against the reference, in both forms: the
// forward against [K, n] weights (pairs of weight rows repacked) and the input gradient against
// them (the weights as they lie, C's transpose in the tiles). K and n around the 32-element steps,
// the forward's 256-row chunks and the 16-row tiles (1, 17, 31, 33, 64, 65, 255, 256, 257, 600,
// 700: a last step from a zero-padded copy, half-zero last pairs, partial column blocks), groups of
// 8 rows (their least), 1 (beside larger ones), 16, 17, 32, 33 and 70 rows (one tile of rows, two,
// several blocks, partial ones) and empty ones, on a shard (group_offset 1; rows outside it
// zero), one thread and two, into f32 and bf16 and accumulating. Where the CPU has AMX,
// amx_forward_takes / amx_dot_takes must say so for these calls.
TEST(RaggedDotStream, AmxEdgesAgainstTheReference) {
  const int before = omp_get_max_threads();
  std::mt19937 rng(17);
  const std::vector<int32_t> sizes{3, 8, 1, 0, 16, 17, 32, 33, 70, 5};
  const int32_t offset = 1;
  const int64_t E_loc = 8, m = 185;
  for (const bool dlhs : {false, true}) {
    for (const int64_t K : {1, 31, 33, 255, 256, 257, 600}) {
      for (const int64_t n : {1, 17, 64, 65, 700}) {
        for (const int threads : {1, 2}) {
          for (const DType out_type : {DType::kF32, DType::kBF16}) {
            for (const bool accumulate : {false, true}) {
              SCOPED_TRACE(fmt::format("{} K {} n {} threads {} out {} accumulate {}",
                                       dlhs ? "dlhs" : "fwd", K, n, threads, dtype_name(out_type),
                                       accumulate));
              omp_set_num_threads(threads);
              const int64_t kc = dlhs ? n : K, cols = dlhs ? K : n;
              HostTensor a(DType::kBF16, {m, kc}), w(DType::kBF16, {E_loc, K, n}),
                  held(out_type, {m, cols});
              a.fill_random(rng);
              w.fill_random(rng);
              held.fill_random(rng);
              auto run = [&](HostTensor& x, HostTensor& y, RaggedDotImpl impl) {
                RaggedDotOptions o;
                o.impl = impl, o.accumulate = accumulate;
                HostTensor out = held;
                const RaggedDotGroups groups(sizes, offset);
                const Status st = dlhs ? ragged_dot_dlhs(x.in(), y.in(), groups, out.mut(), o)
                                       : ragged_dot(x.in(), y.in(), groups, out.mut(), o);
                EXPECT_TRUE(st.ok()) << st.message();
                return out;
              };
              if (cpu_has_amx()) {
                detail::RowGroupedGemm g{};
                g.in_type = DType::kBF16, g.groups.sizes = sizes.data();
                g.groups.count = static_cast<int64_t>(sizes.size()), g.groups.offset = offset;
                g.groups.num_local = E_loc;
                g.b_s0 = dlhs ? 1 : n, g.b_s1 = dlhs ? n : 1;
                // (The input gradient with n = 1 has both strides 1: the forward's form.)
                ASSERT_TRUE(dlhs && n > 1 ? detail::amx_dot_takes(g)
                                          : detail::amx_forward_takes(g));
              }
              HostTensor a_abs = a, w_abs = w, zero = held;
              for (int64_t i = 0; i < a.span(); ++i) a_abs.set_flat(i, std::abs(a.get_flat(i)));
              for (int64_t i = 0; i < w.span(); ++i) w_abs.set_flat(i, std::abs(w.get_flat(i)));
              zero.fill(0.f);
              std::swap(held, zero);
              const HostTensor bound = run(a_abs, w_abs, RaggedDotImpl::kReference);
              std::swap(held, zero);
              const HostTensor want = run(a, w, RaggedDotImpl::kReference),
                               got = run(a, w, RaggedDotImpl::kCpuStream);
              const double rounding = out_type == DType::kBF16 ? 1.0 / 128 : 0.0;
              for (int64_t i = 0; i < got.span(); ++i) {
                ASSERT_NEAR(got.get_flat(i), want.get_flat(i),
                            (kc + 4) * 1.2e-7 * (bound.get_flat(i) + 1) +
                                rounding * std::abs(want.get_flat(i)))
                    << "element " << i;
              }
            }
          }
        }
      }
    }
  }
  omp_set_num_threads(before);
}

// The AMX forward on wide weight rows (n 4100: its chunks of 96 contraction rows, so that their
// pairs fit kPairsBytes; K 300: three whole chunks and one of 12), against the reference.
TEST(RaggedDotStream, AmxForwardWideRowsAgainstTheReference) {
  const int64_t K = 300, n = 4100, m = 29;
  const std::vector<int32_t> sizes{9, 0, 20};
  std::mt19937 rng(23);
  HostTensor a(DType::kBF16, {m, K}), w(DType::kBF16, {3, K, n});
  a.fill_random(rng);
  w.fill_random(rng);
  const auto run = f32_run(sizes, m, n, /*dlhs=*/false);
  StreamChecker(run, a, w, K)(run(a, w, RaggedDotImpl::kCpuStream));
}

// One group holding every row (40) on two threads: the AMX kernels cut it into column slabs, one
// a thread, in both forms; against the reference. The input gradient's contraction (n 512) is two
// whole parts of kDotPartSteps steps over two row blocks, with no zero-padded last step.
TEST(RaggedDotStream, AmxLoneGroupAgainstTheReference) {
  const int before = omp_get_max_threads();
  omp_set_num_threads(2);
  const int64_t K = 300, n = 512, m = 40;
  const std::vector<int32_t> sizes{40};
  std::mt19937 rng(29);
  for (const bool dlhs : {false, true}) {
    SCOPED_TRACE(dlhs ? "dlhs" : "fwd");
    const int64_t kc = dlhs ? n : K, cols = dlhs ? K : n;
    HostTensor a(DType::kBF16, {m, kc}), w(DType::kBF16, {1, K, n});
    a.fill_random(rng);
    w.fill_random(rng);
    const auto run = f32_run(sizes, m, cols, dlhs);
    StreamChecker(run, a, w, kc)(run(a, w, RaggedDotImpl::kCpuStream));
  }
  omp_set_num_threads(before);
}

// The AMX input gradient's other loops, against the reference, its budgets shrunk
// (set_amx_dot_budgets_for_test) so that these small groups take them: pieces whose repacked rows
// fit half of 64 rows' (the 100-row group in 4 pieces of 25, the 60 rows in one); or spans (no
// piece "fits": pieces of at most 40 rows, 100 in 3 and 60 in 2), K = 200 columns in spans of 48
// (sums of 16 KiB; the last span 8 columns) or in one span (64 KiB), the parts outermost within
// it; and the defaults (neither). A contraction of 2048 puts the weight rows 4 KiB apart: the 2 x
// 2 tiles (spans of 64 columns at 16 KiB); 300 the 3 x 1 tiles. Then one group holding every row
// (198): on two threads its pieces are cut into column slabs too, each slab's spans from its own
// first column.
void CheckDotPiecesAndSpans(const std::vector<int32_t>& sizes) {
  const int before = omp_get_max_threads();
  const int64_t m = 198, K = 200, G = static_cast<int64_t>(sizes.size());
  struct Budgets {
    int64_t rows_rows, min_piece_rows, span_piece_rows, sums_bytes;
  };
  const Budgets budgets[] = {{64, 16, 0, 0}, {1, 1000, 40, 16 << 10}, {1, 1000, 40, 64 << 10}};
  std::mt19937 rng(31);
  for (const int64_t n : {300, 2048}) {
    HostTensor a(DType::kBF16, {m, n}), w(DType::kBF16, {G, K, n});
    a.fill_random(rng);
    w.fill_random(rng);
    if (cpu_has_amx()) {
      detail::RowGroupedGemm g{};
      g.in_type = DType::kBF16, g.groups.sizes = sizes.data();
      g.groups.count = g.groups.num_local = G;
      g.b_s0 = 1, g.b_s1 = n;
      ASSERT_TRUE(detail::amx_dot_takes(g));
    }
    const auto run = f32_run(sizes, m, K, /*dlhs=*/true);
    const auto check = StreamChecker(run, a, w, n);
    for (const Budgets& b : budgets) {
      for (const int threads : {1, 2}) {
        SCOPED_TRACE(fmt::format("n {} budgets {} {} {} {} threads {}", n, b.rows_rows,
                                 b.min_piece_rows, b.span_piece_rows, b.sums_bytes, threads));
        omp_set_num_threads(threads);
        detail::set_amx_dot_budgets_for_test(b.rows_rows * n * 2, b.min_piece_rows,
                                             b.span_piece_rows, b.sums_bytes);
        check(run(a, w, RaggedDotImpl::kCpuStream));
      }
    }
    detail::set_amx_dot_budgets_for_test(0, 0, 0, 0);
    omp_set_num_threads(2);
    check(run(a, w, RaggedDotImpl::kCpuStream));
  }
  omp_set_num_threads(before);
}

TEST(RaggedDotStream, AmxInputGradientPiecesSpansAndAliasedRows) {
  CheckDotPiecesAndSpans({100, 0, 37, 1, 60});
  CheckDotPiecesAndSpans({198});
}

// kCpuStream's weight gradient (sums of outer products) on every Highway target this build has:
// an output width of whole aligned vectors (non-temporal stores) and an odd one (plain stores and
// a scalar tail), empty groups (zeros, or left as they were), a shard, accumulation, f32 and bf16
// outputs, against a double-precision oracle.
TEST(RaggedDotStream, WeightGradientOnEveryTarget) {
  struct Shape {
    int64_t K, n;
    std::vector<int32_t> sizes;
    int32_t offset;
    int64_t e_loc;
  };
  const std::vector<Shape> shapes = {{70, 64, {3, 0, 16, 1}, 0, 4},
                                     {133, 37, {0, 5, 2, 9, 0}, 1, 3}};
  std::mt19937 rng(5);
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    hwy::SetSupportedTargetsForTest(target);
    for (const Shape& s : shapes) {
      const int64_t m = std::accumulate(s.sizes.begin(), s.sizes.end(), int64_t{2});
      for (DType out : {DType::kF32, DType::kBF16}) {
        for (bool accumulate : {false, true}) {
          SCOPED_TRACE(
              fmt::format("K {} n {} out {} accumulate {}", s.K, s.n, dtype_name(out), accumulate));
          HostTensor lhs(DType::kBF16, {m, s.K}), d_out(DType::kBF16, {m, s.n}),
              d_rhs(out, {s.e_loc, s.K, s.n});
          lhs.fill_random(rng);
          d_out.fill_random(rng);
          d_rhs.fill_random(rng);
          const HostTensor before = d_rhs;
          RaggedDotOptions o;
          o.impl = RaggedDotImpl::kCpuStream;
          o.accumulate = accumulate;
          RaggedDotImpl ran = RaggedDotImpl::kAuto;
          o.ran = &ran;
          ASSERT_TRUE(
              ragged_dot_drhs(lhs.in(), d_out.in(), {s.sizes, s.offset}, d_rhs.mut(), o).ok());
          EXPECT_EQ(ran, RaggedDotImpl::kCpuStream);
          int failures = 0;
          int64_t row = std::accumulate(s.sizes.begin(), s.sizes.begin() + s.offset, int64_t{0});
          for (int64_t j = 0; j < s.e_loc; ++j) {
            const int64_t rows = s.sizes[s.offset + j];
            for (int64_t k = 0; k < s.K && failures < 5; ++k) {
              for (int64_t c = 0; c < s.n && failures < 5; ++c) {
                double want = accumulate ? before.get({j, k, c}) : 0.0, mag = std::abs(want);
                for (int64_t r = row; r < row + rows; ++r) {
                  const double t = lhs.get({r, k}) * d_out.get({r, c});
                  want += t, mag += std::abs(t);
                }
                const double tol = 1e-6 * mag + (out == DType::kBF16 ? std::abs(want) / 128 : 0.0);
                const double got = d_rhs.get({j, k, c});
                if (!(std::abs(got - want) <= tol)) {
                  ADD_FAILURE() << "d_rhs[" << j << "][" << k << "][" << c << "]: got " << got
                                << ", want " << want << " +- " << tol;
                  ++failures;
                }
              }
            }
            row += rows;
          }
        }
      }
    }
  }
  hwy::SetSupportedTargetsForTest(0);
}

// kCpuStream computes the three passes in the default mode; asked for the batch-invariant mode
// (on weights not packed), it says so.
TEST(RaggedDotStream, RefusesWhatItDoesNotTake) {
  const int64_t K = 8, n = 8;
  std::vector<float> a(100 * K), w(2 * K * n), y(100 * n), dw(2 * K * n);
  const ConstTensorView av(a.data(), DType::kF32, {100, K}), wv(w.data(), DType::kF32, {2, K, n});
  RaggedDotOptions o;
  o.impl = RaggedDotImpl::kCpuStream;
  const std::vector<int32_t> small{50, 50};
  EXPECT_TRUE(ragged_dot(av, wv, small, TensorView(y.data(), DType::kF32, {100, n}), o).ok());
  o.batch_invariant = true;
  Status s = ragged_dot(av, wv, small, TensorView(y.data(), DType::kF32, {100, n}), o);
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
  s = ragged_dot(av, wv, small, TensorView(y.data(), DType::kF32, {100, n}), o);
  EXPECT_NE(s.message().find("batch_invariant"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("impl stream does not take this call"), std::string::npos)
      << s.message();
  s = ragged_dot_drhs(av, ConstTensorView(y.data(), DType::kF32, {100, n}), small,
                      TensorView(dw.data(), DType::kF32, {2, K, n}), o);
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
  EXPECT_NE(s.message().find("impl stream does not take this call"), std::string::npos)
      << s.message();
}

// RaggedDotOptions::ran: the implementation kAuto chose (kCpuStream for few rows per group, by the
// layout's bound: 12 rows for the f32 forward against [K, n] weights (40 on AVX2, 64 where oneDNN
// runs AMX), 160 for its input gradient, 16 for the weight gradient; oneDNN past it), or the one
// named; untouched by a refused call.
TEST(RaggedDot, RanSaysWhichImplementationRan) {
  const int64_t K = 8, n = 8, m = 100;
  std::vector<float> a(m * K, 0.5f), w(2 * K * n, 0.25f), y(m * n), dw(2 * K * n);
  const ConstTensorView av(a.data(), DType::kF32, {m, K}), wv(w.data(), DType::kF32, {2, K, n});
  const TensorView yv(y.data(), DType::kF32, {m, n});
  const ConstTensorView dyv(y.data(), DType::kF32, {m, n});
  const std::vector<int32_t> few{5, 7}, many{95, 5};
  RaggedDotImpl ran = RaggedDotImpl::kAuto;
  RaggedDotOptions o;
  o.ran = &ran;
  ASSERT_TRUE(ragged_dot(av, wv, few, yv, o).ok());
  EXPECT_STREQ(impl_name(ran), "stream");
  ASSERT_TRUE(ragged_dot(av, wv, many, yv, o).ok());
  EXPECT_STREQ(impl_name(ran), "onednn");
  ran = RaggedDotImpl::kAuto;
  // (A group of 95 rows is past the f32 input gradient's bound on AVX2, 32: few, on every CPU.)
  ASSERT_TRUE(ragged_dot_dlhs(dyv, wv, few, TensorView(a.data(), DType::kF32, {m, K}), o).ok());
  EXPECT_STREQ(impl_name(ran), "stream");
  // The weight gradient: sums of outer products up to 16 rows a group, oneDNN past them.
  ASSERT_TRUE(ragged_dot_drhs(av, dyv, few, TensorView(dw.data(), DType::kF32, {2, K, n}), o).ok());
  EXPECT_STREQ(impl_name(ran), "stream");
  const std::vector<int32_t> sixteen{16, 0}, seventeen{17, 16};
  ASSERT_TRUE(
      ragged_dot_drhs(av, dyv, sixteen, TensorView(dw.data(), DType::kF32, {2, K, n}), o).ok());
  EXPECT_STREQ(impl_name(ran), "stream");
  ASSERT_TRUE(
      ragged_dot_drhs(av, dyv, seventeen, TensorView(dw.data(), DType::kF32, {2, K, n}), o).ok());
  EXPECT_STREQ(impl_name(ran), "onednn");
  o.impl = RaggedDotImpl::kReference;
  ASSERT_TRUE(ragged_dot(av, wv, few, yv, o).ok());
  EXPECT_STREQ(impl_name(ran), "reference");
  o.impl = RaggedDotImpl::kCpuStream;
  o.batch_invariant = true;  // refused: kCpuStream does not keep the mode's bits
  EXPECT_FALSE(ragged_dot(av, wv, few, yv, o).ok());
  EXPECT_STREQ(impl_name(ran), "reference");
}

// Each implementation has a name of its own (the errors and moekit bench's --impl use them);
// "unknown" past the enum.
TEST(RaggedDot, ImplNames) {
  std::vector<std::string> names;
  for (int i = 0; i <= static_cast<int>(RaggedDotImpl::kCudaSm90Cooperative256Runs); ++i)
    names.emplace_back(impl_name(static_cast<RaggedDotImpl>(i)));
  std::vector<std::string> unique = names;
  std::sort(unique.begin(), unique.end());
  unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
  EXPECT_EQ(unique.size(), names.size());
  EXPECT_EQ(std::count(names.begin(), names.end(), "unknown"), 0);
  EXPECT_STREQ(impl_name(static_cast<RaggedDotImpl>(
                   static_cast<int>(RaggedDotImpl::kCudaSm90Cooperative256Runs) + 1)),
               "unknown");
  EXPECT_STREQ(impl_name(RaggedDotImpl::kCpuStream), "stream");
  EXPECT_STREQ(impl_name(RaggedDotImpl::kOneDnn), "onednn");
  EXPECT_STREQ(impl_name(static_cast<RaggedDotImpl>(99)), "unknown");
}

// With group_offset = 0 and E_loc = G every row of every group is computed (the plain
// jax.lax.ragged_dot), and a zero-row input is fine with null data.
TEST(RaggedDot, EmptyInputWithNullData) {
  std::vector<int32_t> sizes{0, 0};
  std::vector<float> rhs(2 * 3 * 4, 1.f);
  ConstTensorView lhs(nullptr, DType::kF32, {0, 3});
  TensorView out(nullptr, DType::kF32, {0, 4});
  EXPECT_TRUE(
      ragged_dot(lhs, ConstTensorView(rhs.data(), DType::kF32, {2, 3, 4}), sizes, out).ok());
}

// Many groups with bf16 outputs take the path where groups run on different threads at once (and
// the f32 accumulation goes through scratch memory). Repeated calls must give identical bytes: a
// race between threads shows up as a difference. (This caught a shared oneDNN scratchpad.)
TEST(RaggedDotThreads, RepeatedCallsGiveIdenticalBytes) {
  const int64_t m = 700, K = 48, n = 40, G = 64;
  std::mt19937 rng(99);
  HostTensor lhs(DType::kBF16, {m, K}), rhs(DType::kBF16, {G, K, n}), d_out(DType::kBF16, {m, n});
  lhs.fill_random(rng);
  rhs.fill_random(rng);
  d_out.fill_random(rng);
  const std::vector<int32_t> sizes = random_sizes(rng, G, m);
  auto run_all = [&] {
    HostTensor y(DType::kBF16, {m, n}), d_lhs(DType::kBF16, {m, K}), d_rhs(DType::kBF16, {G, K, n});
    EXPECT_TRUE(ragged_dot(lhs.in(), rhs.in(), sizes, y.mut()).ok());
    EXPECT_TRUE(ragged_dot_dlhs(d_out.in(), rhs.in(), sizes, d_lhs.mut()).ok());
    EXPECT_TRUE(ragged_dot_drhs(lhs.in(), d_out.in(), sizes, d_rhs.mut()).ok());
    return std::tuple(y.bytes, d_lhs.bytes, d_rhs.bytes);
  };
  const auto first = run_all();
  for (int i = 0; i < 30; ++i) {
    const auto again = run_all();
    ASSERT_TRUE(std::get<0>(again) == std::get<0>(first)) << "forward differs on repeat " << i;
    ASSERT_TRUE(std::get<1>(again) == std::get<1>(first))
        << "input gradient differs on repeat " << i;
    ASSERT_TRUE(std::get<2>(again) == std::get<2>(first))
        << "weight gradient differs on repeat " << i;
  }
}

// ---------------------------------------------------------------------------------------------
// The batch-invariant mode: a row's bits do not depend on the other rows or the threads.

// One probe row placed among others: in local group 1 of G = 5 groups (E_loc = 3 at `offset`, so
// the probe's group is global group offset + 1), at row `at` of a group of `size` rows; the other
// groups random; `extra` rows past the groups. Returns the probe's output row's bytes.
struct Placement {
  int64_t size, at, extra;
  int32_t offset;
  int threads;
};

using DTypes = std::pair<DType, DType>;  // input, output

class BatchInvariant
    : public ::testing::TestWithParam<std::tuple<DTypes, bool /*transposed*/, bool /*dlhs*/>> {
 protected:
  static constexpr int64_t K = 192, n = 160, kELoc = 3, kG = 5;
  DType in = std::get<0>(GetParam()).first, out = std::get<0>(GetParam()).second;
  bool transposed = std::get<1>(GetParam()), dlhs = std::get<2>(GetParam());
  // The pass's input width and output width: the forward maps K to n, the input gradient n to K.
  int64_t width_in() const { return dlhs ? n : K; }
  int64_t width_out() const { return dlhs ? K : n; }

  std::vector<std::byte> probe_output(const HostTensor& probe, HostTensor& rhs, const Placement& p,
                                      std::mt19937& rng) {
    std::vector<int32_t> sizes = random_sizes(rng, kG, 3 * p.size + 40);
    sizes[p.offset + 1] = static_cast<int32_t>(p.size);
    int64_t start = 0;
    for (int32_t j = 0; j < p.offset + 1; ++j) start += sizes[j];
    int64_t m = p.extra;
    for (int32_t v : sizes) m += v;
    HostTensor a(in, {m, width_in()}), c(out, {m, width_out()});
    a.fill_random(rng);
    const size_t row_bytes = width_in() * dtype_size(in);
    std::memcpy(a.bytes.data() + (start + p.at) * row_bytes, probe.bytes.data(), row_bytes);
    RaggedDotOptions opt;
    opt.batch_invariant = true;
    opt.rhs_transposed = transposed;
    omp_set_num_threads(p.threads);
    const RaggedDotGroups groups{sizes, p.offset};
    const Status st = dlhs ? ragged_dot_dlhs(a.in(), rhs.in(), groups, c.mut(), opt)
                           : ragged_dot(a.in(), rhs.in(), groups, c.mut(), opt);
    EXPECT_TRUE(st.ok()) << st.message();
    const size_t out_bytes = width_out() * dtype_size(out);
    const auto* row = c.bytes.data() + (start + p.at) * out_bytes;
    return {row, row + out_bytes};
  }
};

// (A bf16 output is the f32 sum rounded once, so its cases hold when the f32-output ones do; at
// these sizes the rounding hides the default mode's differences, which the f32 outputs show.)
TEST_P(BatchInvariant, ARowIsTheSameBitsAmongAnyOtherRows) {
  std::mt19937 rng(7);
  HostTensor probe(in, {1, width_in()});
  probe.fill_random(rng);
  HostTensor rhs(
      in, transposed ? std::vector<int64_t>{kELoc, n, K} : std::vector<int64_t>{kELoc, K, n});
  rhs.fill_random(rng);
  const int threads = omp_get_max_threads();
  const std::vector<std::byte> alone = probe_output(probe, rhs, {1, 0, 0, 0, 1}, rng);
  // Group sizes across the mode's block bounds (16, 512), the probe at either end of its group
  // and in a block of its own past the first, other offsets, rows past the groups, 1-3 threads.
  const Placement placements[] = {
      {1, 0, 5, 2, 2},     {2, 1, 0, 0, 2},     {7, 3, 0, 1, 1},       {15, 14, 0, 0, 2},
      {16, 0, 3, 0, 2},    {17, 16, 0, 2, 1},   {64, 33, 0, 0, 3},     {255, 254, 0, 1, 2},
      {256, 100, 0, 0, 2}, {257, 256, 0, 0, 2}, {270, 260, 1, 2, 2},   {600, 599, 0, 0, 2},
      {600, 0, 0, 1, 1},   {513, 512, 0, 0, 2}, {1030, 1025, 0, 2, 2}, {4096, 3000, 0, 0, 2}};
  for (const Placement& p : placements) {
    EXPECT_TRUE(probe_output(probe, rhs, p, rng) == alone)
        << "the probe row differs in a group of " << p.size << " rows at row " << p.at
        << ", offset " << p.offset << ", " << p.threads << " threads";
  }
  omp_set_num_threads(threads);
}

INSTANTIATE_TEST_SUITE_P(DTypes, BatchInvariant,
                         ::testing::Combine(::testing::Values(DTypes{DType::kF32, DType::kF32},
                                                              DTypes{DType::kBF16, DType::kF32},
                                                              DTypes{DType::kBF16, DType::kBF16}),
                                            ::testing::Bool(), ::testing::Bool()),
                         [](const auto& info) {
                           const DTypes types = std::get<0>(info.param);
                           const char* in = types.first == DType::kF32 ? "f32" : "bf16";
                           const char* out = types.second == DType::kF32 ? "f32" : "bf16";
                           return fmt::format("{}_to_{}{}_{}", in, out,
                                              std::get<1>(info.param) ? "_T" : "",
                                              std::get<2>(info.param) ? "dlhs" : "fwd");
                         });

// The weight gradient: the same rows of a group give the same bits, whatever the other groups,
// the offset and the threads.
// K = 64: the default mode's bits follow the threads here; K = 600 (with rows >= 2048): the mode
// splits the group's output rows over several calls.
TEST(BatchInvariantWeightGradient, TheSameRowsGiveTheSameBits) {
  for (auto [t, K] :
       {std::pair{DType::kF32, 64}, {DType::kBF16, 64}, {DType::kF32, 600}, {DType::kBF16, 600}}) {
    std::mt19937 rng(11);
    const int64_t n = 48, rows = 3000, G = 6, e_loc = 3;
    HostTensor x(t, {rows, K}), dy(t, {rows, n});
    x.fill_random(rng);
    dy.fill_random(rng);
    std::vector<std::byte> first;
    for (auto [offset, threads] : {std::pair{0, 1}, {3, 2}, {1, 2}, {2, 3}, {0, 2}}) {
      // Local group 1 holds the rows of x and dy; the others random.
      std::vector<int32_t> sizes = random_sizes(rng, G, 2000 + 50 * offset);
      sizes[offset + 1] = rows;
      int64_t start = 0, m = 0;
      for (int j = 0; j < offset + 1; ++j) start += sizes[j];
      for (int32_t v : sizes) m += v;
      HostTensor lhs(t, {m, K}), d_out(t, {m, n}), d_rhs(DType::kF32, {e_loc, K, n});
      lhs.fill_random(rng);
      d_out.fill_random(rng);
      std::memcpy(lhs.bytes.data() + start * K * dtype_size(t), x.bytes.data(), x.bytes.size());
      std::memcpy(d_out.bytes.data() + start * n * dtype_size(t), dy.bytes.data(), dy.bytes.size());
      RaggedDotOptions opt;
      opt.batch_invariant = true;
      const int before = omp_get_max_threads();
      omp_set_num_threads(threads);
      ASSERT_TRUE(ragged_dot_drhs(lhs.in(), d_out.in(), {sizes, offset}, d_rhs.mut(), opt).ok());
      omp_set_num_threads(before);
      const auto* g1 = d_rhs.bytes.data() + K * n * sizeof(float);
      const std::vector<std::byte> got(g1, g1 + K * n * sizeof(float));
      if (first.empty()) first = got;
      EXPECT_TRUE(got == first) << "group 1's gradient differs at offset " << offset << " with "
                                << threads << " threads, K = " << K;
    }
  }
}

// The mode is the CPU's: a CUDA call with it is refused before anything runs.
TEST(BatchInvariant, RefusedOnCudaBuffers) {
  std::vector<float> lhs(4 * 3, 1.f), rhs(2 * 3 * 5, 1.f), out(4 * 5, 42.f);
  std::vector<int32_t> sizes{2, 2};
  RaggedDotOptions opt;
  opt.batch_invariant = true;
  Exec exec;
  exec.device = Device::kCuda;
  const Status st = ragged_dot(ConstTensorView(lhs.data(), DType::kF32, {4, 3}),
                               ConstTensorView(rhs.data(), DType::kF32, {2, 3, 5}), sizes,
                               TensorView(out.data(), DType::kF32, {4, 5}), opt, exec);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find(cuda_built() ? "batch_invariant" : "CUDA"), std::string::npos)
      << st.message();
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == 42.f; }));
}

// ---------------------------------------------------------------------------------------------
// Bad input: a named error, and nothing written.

struct BadInput : ::testing::Test {
  std::vector<float> lhs = std::vector<float>(10 * 4, 1.f),
                     rhs = std::vector<float>(3 * 4 * 5, 1.f);
  std::vector<float> out = std::vector<float>(10 * 5, 42.f),
                     d_rhs = std::vector<float>(3 * 4 * 5, 42.f);
  std::vector<int32_t> sizes{3, 3, 4};
  ConstTensorView L() const { return {lhs.data(), DType::kF32, {10, 4}}; }
  ConstTensorView R() const { return {rhs.data(), DType::kF32, {3, 4, 5}}; }
  TensorView O() { return {out.data(), DType::kF32, {10, 5}}; }

  void expect_error(const Status& s, const std::string& argument) {
    EXPECT_FALSE(s.ok());
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
    EXPECT_EQ(s.argument(), argument) << s.message();
    EXPECT_NE(s.message().find(argument), std::string::npos) << s.message();
    for (float v : out) ASSERT_EQ(v, 42.f) << "output written despite error: " << s.message();
    for (float v : d_rhs) ASSERT_EQ(v, 42.f) << "d_rhs written despite error: " << s.message();
  }
};

TEST_F(BadInput, NegativeGroupSize) {
  sizes = {3, -1, 4};
  const Status s = ragged_dot(L(), R(), sizes, O());
  expect_error(s, "group_sizes[1]");
  EXPECT_EQ(s.value(), "-1");
}

TEST_F(BadInput, SizesSumPastM) {
  sizes = {3, 3, 5};
  const Status s = ragged_dot(L(), R(), sizes, O());
  expect_error(s, "sum(group_sizes)");
  EXPECT_EQ(s.value(), "11");
}

TEST_F(BadInput, OffsetOutOfRange) {
  sizes = {2, 2, 2, 2};  // G = 4, E_loc = 3: offsets 0 and 1 are valid
  expect_error(ragged_dot(L(), R(), {sizes, 2}, O()), "group_offset");
  expect_error(ragged_dot(L(), R(), {sizes, -1}, O()), "group_offset");
  expect_error(ragged_dot_drhs(L(), ConstTensorView(out.data(), DType::kF32, {10, 5}), {sizes, -1},
                               TensorView(d_rhs.data(), DType::kF32, {3, 4, 5})),
               "group_offset");
}

TEST_F(BadInput, FewerGroupsThanLocalExperts) {
  sizes = {5, 5};
  expect_error(ragged_dot(L(), R(), sizes, O()), "group_sizes.size()");
}

TEST_F(BadInput, ShapeMismatch) {
  expect_error(ragged_dot(L(), ConstTensorView(rhs.data(), DType::kF32, {3, 5, 4}), sizes, O()),
               "rhs.shape");
  expect_error(ragged_dot(L(), R(), sizes, TensorView(out.data(), DType::kF32, {10, 4})),
               "out.shape");
  expect_error(ragged_dot(L(), R(), sizes, TensorView(out.data(), DType::kF32, {9, 5})),
               "out.shape");
  expect_error(ragged_dot(L(), ConstTensorView(rhs.data(), DType::kF32, {12, 5}), sizes, O()),
               "rhs.rank");
  expect_error(ragged_dot_dlhs(ConstTensorView(out.data(), DType::kF32, {10, 4}), R(), sizes,
                               TensorView(lhs.data(), DType::kF32, {10, 4})),
               "rhs.shape");
  expect_error(ragged_dot_drhs(L(), ConstTensorView(out.data(), DType::kF32, {10, 5}), sizes,
                               TensorView(d_rhs.data(), DType::kF32, {3, 5, 4})),
               "d_rhs.shape");
  expect_error(ragged_dot_drhs(L(), ConstTensorView(out.data(), DType::kF32, {9, 5}), sizes,
                               TensorView(d_rhs.data(), DType::kF32, {3, 4, 5})),
               "d_out.shape");
}

TEST_F(BadInput, DtypeMismatch) {
  expect_error(ragged_dot(L(), ConstTensorView(rhs.data(), DType::kBF16, {3, 4, 5}), sizes, O()),
               "rhs.dtype");
  expect_error(ragged_dot(L(), R(), sizes, TensorView(out.data(), DType::kBF16, {10, 5})),
               "out.dtype");
  expect_error(ragged_dot(ConstTensorView(lhs.data(), DType::kI32, {10, 4}), R(), sizes, O()),
               "lhs.dtype");
  expect_error(ragged_dot_drhs(L(), ConstTensorView(out.data(), DType::kBF16, {10, 5}), sizes,
                               TensorView(d_rhs.data(), DType::kF32, {3, 4, 5})),
               "d_out.dtype");
}

TEST_F(BadInput, NullPointers) {
  expect_error(ragged_dot(ConstTensorView(nullptr, DType::kF32, {10, 4}), R(), sizes, O()),
               "lhs.data");
  expect_error(ragged_dot(L(), ConstTensorView(nullptr, DType::kF32, {3, 4, 5}), sizes, O()),
               "rhs.data");
  expect_error(ragged_dot(L(), R(), sizes, TensorView(nullptr, DType::kF32, {10, 5})), "out.data");
  expect_error(
      ragged_dot(L(), R(), std::span<const int32_t>(static_cast<const int32_t*>(nullptr), 3), O()),
      "group_sizes.data");
}

TEST_F(BadInput, DeviceAndImplementationMustMatchTheBuffers) {
  RaggedDotGroups on_device(sizes);
  const int32_t offset = 0;
  on_device.device_offset = &offset;  // a device offset with host buffers
  expect_error(ragged_dot(L(), R(), on_device, O()), "groups.device_offset");
  Exec bogus;
  bogus.device = static_cast<Device>(7);
  expect_error(ragged_dot(L(), R(), sizes, O(), {}, bogus), "exec.device");
  // A CUDA implementation named for host buffers says what it needs; nothing is written.
  std::fill(out.begin(), out.end(), 5.0f);
  RaggedDotOptions cuda;
  cuda.impl = RaggedDotImpl::kCudaPortable;
  const Status s = ragged_dot(L(), R(), sizes, O(), cuda);
  EXPECT_EQ(s.code(), cuda_built() ? StatusCode::kUnimplemented : StatusCode::kInvalidArgument)
      << s.message();
  if (cuda_built()) EXPECT_NE(s.message().find("CUDA buffers"), std::string::npos) << s.message();
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == 5.0f; }));
}

TEST_F(BadInput, Strides) {
  expect_error(ragged_dot(L().with_stride(1, 2), R(), sizes, O()), "lhs.stride[1]");
  expect_error(ragged_dot(L(), R(), sizes, O().with_stride(0, 4)), "out.stride[0]");
  expect_error(ragged_dot(L(), R().with_stride(0, 10), sizes, O()), "rhs.stride[0]");
}

}  // namespace
}  // namespace moekit
