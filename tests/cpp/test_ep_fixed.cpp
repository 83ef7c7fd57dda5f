// The layouts around an exchange of fixed-size blocks (ep_pack, ep_regroup, ep_ungroup,
// ep_unpack): P ranks simulated in one process, the all-to-all in between done here by moving
// block q of rank p's send buffer into block p of rank q's receive buffer. Regrouped, the rows
// must be where ep_dispatch puts them; back through ungroup, the all-to-all and unpack, every
// row must come back bit for bit, and every row nothing was sent to must be 0.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ep_rows.h"
#include "host_tensor.h"
#include "moekit/ep.h"

namespace moekit {
namespace {

using test::rows_of;
using test::same_row;

bool row_zero(const HostTensor& a, int64_t r, int64_t H) {
  const size_t n = static_cast<size_t>(H) * dtype_size(a.dtype);
  return std::all_of(a.bytes.begin() + r * n, a.bytes.begin() + (r + 1) * n,
                     [](std::byte b) { return b == std::byte{0}; });
}

ConstTensorView i32(const std::vector<int32_t>& v, std::initializer_list<int64_t> shape) {
  return ConstTensorView(v.data(), DType::kI32, shape);
}

struct Case {
  int P;
  int64_t El, H;
  DType dt;
  bool skew;  // every row to rank 0's experts
};

TEST(EpFixed, PackExchangeRegroupIsDispatchAndTheWayBackIsTheIdentity) {
  std::vector<Case> cases;
  for (int P : {1, 2, 3, 4}) {
    for (int64_t El : {1, 3}) {
      cases.push_back({P, El, 5, DType::kF32, false});
      cases.push_back({P, El, 1, DType::kBF16, true});
      cases.push_back({P, El, 7, DType::kI32, false});
    }
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message()
                 << "P=" << c.P << " E_loc=" << c.El << " H=" << c.H << " skew=" << c.skew);
    const int P = c.P;
    const int64_t E = P * c.El, H = c.H;
    std::mt19937 rng(static_cast<unsigned>(P * 100 + c.El));
    std::uniform_int_distribution<int> d(0, 6);
    // Rank p's rows per expert, and its x_perm with two rows past them.
    std::vector<std::vector<int32_t>> counts(static_cast<size_t>(P));
    std::vector<int64_t> N(static_cast<size_t>(P));
    for (int p = 0; p < P; ++p) {
      for (int64_t e = 0; e < E; ++e) {
        counts[p].push_back(c.skew && e >= c.El ? 0 : (p == 1 ? 0 : d(rng)));  // rank 1: none
      }
      for (int32_t x : counts[p]) N[p] += x;
    }
    int64_t C = 0;  // dropless: a block holds all of a rank's rows
    for (int64_t n : N) C = std::max(C, n);
    std::vector<HostTensor> x_perm, send, recv, back, out;
    for (int p = 0; p < P; ++p) {
      x_perm.push_back(rows_of(p, N[p] + 2, H, c.dt));
      send.emplace_back(c.dt, std::vector<int64_t>{P, C, H});
      std::fill(send[p].bytes.begin(), send[p].bytes.end(), std::byte{0xAB});
      ConstTensorView used = x_perm[p].in();
      ASSERT_TRUE(ep_pack(used, i32(counts[p], {E}), send[p].mut()).ok());
    }
    // The all-to-all: rank p's block q lands in rank q's block p.
    for (int q = 0; q < P; ++q) recv.emplace_back(c.dt, std::vector<int64_t>{P, C, H});
    const size_t block = static_cast<size_t>(C * H) * dtype_size(c.dt);
    auto all_to_all = [&](std::vector<HostTensor>& from, std::vector<HostTensor>& to) {
      for (int p = 0; p < P; ++p) {
        for (int q = 0; q < P; ++q) {
          std::memcpy(to[q].bytes.data() + p * block, from[p].bytes.data() + q * block, block);
        }
      }
    };
    all_to_all(send, recv);
    for (int q = 0; q < P; ++q) {
      // What rank q received for each local expert, from each source.
      std::vector<int32_t> rtpe;
      int64_t R = 0;
      for (int p = 0; p < P; ++p) {
        for (int64_t j = 0; j < c.El; ++j) {
          rtpe.push_back(counts[p][q * c.El + j]);
          R += rtpe.back();
        }
      }
      HostTensor x_local(c.dt, {P * C, H});
      std::fill(x_local.bytes.begin(), x_local.bytes.end(), std::byte{0xCD});
      ASSERT_TRUE(ep_regroup(recv[q].in(), i32(rtpe, {P, c.El}), x_local.mut()).ok());
      // [local expert][source rank], each source's rows in its own order; then zeros.
      int64_t row = 0;
      for (int64_t j = 0; j < c.El; ++j) {
        for (int p = 0; p < P; ++p) {
          int64_t first = 0;  // the first row of expert q*El + j in rank p's x_perm
          for (int64_t e = 0; e < q * c.El + j; ++e) first += counts[p][e];
          for (int32_t i = 0; i < counts[p][q * c.El + j]; ++i, ++row) {
            EXPECT_TRUE(same_row(x_local, row, x_perm[p], first + i))
                << "x_local row " << row << " of rank " << q;
          }
        }
      }
      EXPECT_EQ(row, R);
      for (int64_t r = R; r < P * C; ++r) EXPECT_TRUE(row_zero(x_local, r, H)) << r;
      // And back: ungroup into blocks whose unused rows must come out 0.
      back.emplace_back(c.dt, std::vector<int64_t>{P, C, H});
      std::fill(back[q].bytes.begin(), back[q].bytes.end(), std::byte{0xEF});
      ASSERT_TRUE(ep_ungroup(x_local.in(), i32(rtpe, {P, c.El}), back[q].mut()).ok());
      EXPECT_EQ(std::memcmp(back[q].bytes.data(), recv[q].bytes.data(),
                            static_cast<size_t>(P) * block) == 0,
                true)
          << "ungroup is not regroup's inverse on rank " << q;
    }
    std::vector<HostTensor> returned;
    for (int p = 0; p < P; ++p) returned.emplace_back(c.dt, std::vector<int64_t>{P, C, H});
    all_to_all(back, returned);
    for (int p = 0; p < P; ++p) {
      HostTensor y_perm(c.dt, {N[p] + 2, H});
      std::fill(y_perm.bytes.begin(), y_perm.bytes.end(), std::byte{0x12});
      ASSERT_TRUE(ep_unpack(returned[p].in(), i32(counts[p], {E}), y_perm.mut()).ok());
      for (int64_t r = 0; r < N[p]; ++r) EXPECT_TRUE(same_row(y_perm, r, x_perm[p], r)) << r;
      for (int64_t r = N[p]; r < N[p] + 2; ++r) EXPECT_TRUE(row_zero(y_perm, r, H)) << r;
    }
  }
}

TEST(EpFixed, CountsThatDoNotFitAreNamedAndNothingIsWritten) {
  const std::vector<int32_t> counts = {2, 1, 3, 0};  // 2 ranks of 2 experts: 3 rows, then 3
  HostTensor x = rows_of(0, 6, 4, DType::kF32);
  HostTensor send(DType::kF32, {2, 2, 4});  // blocks of 2 rows: too small
  std::fill(send.bytes.begin(), send.bytes.end(), std::byte{0x5A});
  const std::vector<std::byte> before = {send.bytes.begin(), send.bytes.end()};
  Status s = ep_pack(x.in(), i32(counts, {4}), send.mut());
  EXPECT_EQ(s.argument(), "the rows for rank 0") << s.message();
  EXPECT_NE(s.message().find("C = 2"), std::string::npos) << s.message();
  EXPECT_TRUE(std::equal(before.begin(), before.end(), send.bytes.begin()));

  const std::vector<int32_t> negative = {2, -1, 3, 0};
  HostTensor wide(DType::kF32, {2, 4, 4});
  s = ep_pack(x.in(), i32(negative, {4}), wide.mut());
  EXPECT_EQ(s.argument(), "tokens_per_expert[1]") << s.message();

  const std::vector<int32_t> three = {1, 1, 1};  // 3 experts over 2 blocks
  s = ep_pack(x.in(), i32(three, {3}), wide.mut());
  EXPECT_EQ(s.argument(), "tokens_per_expert.shape[0]") << s.message();

  HostTensor small(DType::kF32, {5, 4});  // 6 rows do not fit 5
  s = ep_unpack(wide.in(), i32(counts, {4}), small.mut());
  EXPECT_EQ(s.argument(), "sum(tokens_per_expert)") << s.message();

  const std::vector<int32_t> rtpe = {2, 3, 1, 0};  // from rank 0: 5 rows into blocks of 4
  HostTensor x_local(DType::kF32, {8, 4});
  s = ep_regroup(wide.in(), i32(rtpe, {2, 2}), x_local.mut());
  EXPECT_EQ(s.argument(), "the rows from rank 0") << s.message();

  HostTensor bf(DType::kBF16, {2, 4, 4});
  s = ep_pack(x.in(), i32(counts, {4}), bf.mut());
  EXPECT_EQ(s.argument(), "send.dtype") << s.message();

  // Output overlapping the input.
  HostTensor both(DType::kF32, {14, 4});
  ConstTensorView in = both.in();
  in.shape[0] = 6;
  TensorView out = both.mut();
  out.rank = 3;
  out.shape = {2, 4, 4, 0};
  out.stride = {16, 4, 1, 0};
  s = ep_pack(in, i32(counts, {4}), out);
  EXPECT_NE(s.message().find("overlaps x_perm"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace moekit
