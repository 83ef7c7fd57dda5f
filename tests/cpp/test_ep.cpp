// The expert-parallel plan, dispatch and combine (include/moekit/ep.h) against a reference built
// from every rank's counts: which rows each rank receives, in which order, and the way back; the
// errors every rank must see; the engines' collectives. One source for both engines: the thread
// engine in moekit_tests (P = 1..4 threads), the MPI engine in moekit_ep_mpi_tests under
// mpiexec -n 1..4 (see ep_ranks.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "ep_ranks.h"
#include "ep_rows.h"
#include "host_tensor.h"
#include "moekit/ep.h"

namespace moekit {
namespace {

using test::on_ranks;
using test::rank_counts;
using test::rows_of;
using test::same_row;

enum class Routing {
  kRandom,     // 0..9 rows per expert, some experts empty
  kSkewed,     // every rank sends everything to rank 0's experts
  kEmptyRank,  // as kRandom, but the last rank has no tokens
};
constexpr Routing kRoutings[] = {Routing::kRandom, Routing::kSkewed, Routing::kEmptyRank};

// Rank q's rows per expert: the same function on every rank, so that each knows the others'.
std::vector<int32_t> counts_of(Routing r, int q, int P, int64_t E) {
  std::mt19937 rng(1000u * static_cast<unsigned>(q) + 17u * static_cast<unsigned>(P) +
                   static_cast<unsigned>(E) + 7919u * static_cast<unsigned>(r));
  std::uniform_int_distribution<int> rows(0, 9);
  std::vector<int32_t> c(static_cast<size_t>(E));
  for (int32_t& x : c) x = rows(rng);
  for (int64_t e = 0; e < E; ++e) {
    if ((r == Routing::kSkewed && e >= E / P) || (r == Routing::kEmptyRank && q == P - 1)) {
      c[static_cast<size_t>(e)] = 0;
    }
  }
  return c;
}

std::vector<std::vector<int32_t>> all_counts(Routing r, int P, int64_t E) {
  std::vector<std::vector<int32_t>> all;
  for (int q = 0; q < P; ++q) all.push_back(counts_of(r, q, P, E));
  return all;
}

int64_t sum(const std::vector<int32_t>& c) {
  int64_t s = 0;
  for (int32_t x : c) s += x;
  return s;
}

HostTensor filled(DType dt, int64_t rows, int64_t H, uint8_t byte) {
  HostTensor t(dt, {rows, H});
  std::fill(t.bytes.begin(), t.bytes.end(), std::byte{byte});
  return t;
}

bool row_is(const HostTensor& a, int64_t r, uint8_t byte) {
  const size_t n = static_cast<size_t>(a.shape[1]) * dtype_size(a.dtype);
  for (size_t i = 0; i < n; ++i) {
    if (a.bytes[r * n + i] != std::byte{byte}) return false;
  }
  return true;
}

// Where each row of rank p's x_local comes from, worked out without the plan: every row sent to
// p, as (local expert, source rank, row of the source's x_perm), sorted.
struct Source {
  int64_t local_expert;
  int rank;
  int64_t row;
  bool operator<(const Source& o) const {
    return std::tie(local_expert, rank, row) < std::tie(o.local_expert, o.rank, o.row);
  }
};
std::vector<Source> local_rows(const std::vector<std::vector<int32_t>>& counts, int p) {
  const int P = static_cast<int>(counts.size());
  const int64_t E = static_cast<int64_t>(counts[0].size()), El = E / P;
  std::vector<Source> rows;
  for (int q = 0; q < P; ++q) {
    int64_t row = 0;
    for (int64_t e = 0; e < E; ++e) {
      for (int32_t i = 0; i < counts[q][e]; ++i, ++row) {
        if (e / El == p) rows.push_back({e % El, q, row});
      }
    }
  }
  std::sort(rows.begin(), rows.end());
  return rows;
}

ConstTensorView counts_view(const std::vector<int32_t>& c) {
  return ConstTensorView(c.data(), DType::kI32, {static_cast<int64_t>(c.size())});
}

TEST(Ep, PlanMatchesTheCountsOfEveryRank) {
  for (int P : rank_counts()) {
    for (int64_t El : {1, 3}) {
      for (Routing routing : kRoutings) {
        const int64_t E = P * El;
        const auto counts = all_counts(routing, P, E);
        on_ranks(P, [&](Communicator& comm) {
          const int p = comm.rank();
          SCOPED_TRACE(testing::Message() << "P=" << P << " E=" << E << " rank " << p << " routing "
                                          << static_cast<int>(routing));
          EpPlan plan;
          ASSERT_TRUE(ep_plan(counts_view(counts[p]), comm, &plan).ok());
          EXPECT_EQ(plan.num_ranks, P);
          EXPECT_EQ(plan.rank, p);
          EXPECT_EQ(plan.num_experts, E);
          EXPECT_EQ(plan.num_local_experts, El);
          EXPECT_EQ(plan.tokens_per_expert, counts[p]);
          int64_t row = 0;
          for (int q = 0; q < P; ++q) {
            EXPECT_EQ(plan.send_offsets[q], row) << "q=" << q;
            int64_t to_q = 0, from_q = 0;
            for (int64_t j = 0; j < El; ++j) {
              EXPECT_EQ(plan.expert_offsets[q * El + j], row + to_q);
              to_q += counts[p][q * El + j];
              from_q += counts[q][p * El + j];
              EXPECT_EQ(plan.recv_tokens_per_expert[q * El + j], counts[q][p * El + j]);
            }
            EXPECT_EQ(plan.send_counts[q], to_q);
            EXPECT_EQ(plan.recv_counts[q], from_q);
            row += to_q;
          }
          EXPECT_EQ(plan.send_rows, sum(counts[p]));
          // Local offsets and group sizes from the sorted list of every row p receives.
          const std::vector<Source> rows = local_rows(counts, p);
          EXPECT_EQ(plan.recv_rows, static_cast<int64_t>(rows.size()));
          for (int64_t j = 0; j < El; ++j) {
            EXPECT_EQ(plan.local_tokens_per_expert[j],
                      std::count_if(rows.begin(), rows.end(),
                                    [&](const Source& s) { return s.local_expert == j; }));
            for (int q = 0; q < P; ++q) {
              const auto first = std::find_if(rows.begin(), rows.end(), [&](const Source& s) {
                return s.local_expert > j || (s.local_expert == j && s.rank >= q);
              });
              EXPECT_EQ(plan.local_offsets[q * El + j], first - rows.begin());
            }
          }
          int64_t recv_offset = 0;
          for (int q = 0; q < P; ++q) {
            EXPECT_EQ(plan.recv_offsets[q], recv_offset);
            recv_offset += plan.recv_counts[q];
          }
          for (int64_t e = 0; e < E; ++e) {
            int64_t g = 0;
            for (int q = 0; q < P; ++q) {
              g += counts[q][e];
              EXPECT_EQ(plan.all_tokens_per_expert[q * E + e], counts[q][e]);
            }
            EXPECT_EQ(plan.global_tokens_per_expert[e], g);
          }
          std::vector<uint64_t> prints(static_cast<size_t>(P));
          ASSERT_TRUE(comm.all_gather(&plan.fingerprint, prints.data(), sizeof(uint64_t)).ok());
          for (uint64_t f : prints) EXPECT_EQ(f, plan.fingerprint);
        });
      }
    }
  }
}

// x_perm with two rows past the plan's: they must not move, and the tails of the outputs must be
// left as they were.
TEST(Ep, DispatchRegroupsByLocalExpertAndCombineUndoesItBitForBit) {
  struct Row {
    int64_t H;
    DType dt;
  };
  for (int P : rank_counts()) {
    for (int64_t El : {1, 3}) {
      for (Routing routing : kRoutings) {
        for (Row shape : {Row{1, DType::kI32}, Row{7, DType::kBF16}, Row{111, DType::kF32}}) {
          const int64_t E = P * El, H = shape.H;
          const DType dt = shape.dt;
          const auto counts = all_counts(routing, P, E);
          on_ranks(P, [&](Communicator& comm) {
            const int p = comm.rank();
            SCOPED_TRACE(testing::Message() << "P=" << P << " E=" << E << " H=" << H << " rank "
                                            << p << " routing " << static_cast<int>(routing));
            EpPlan plan;
            ASSERT_TRUE(ep_plan(counts_view(counts[p]), comm, &plan).ok());
            HostTensor x_perm = rows_of(p, plan.send_rows + 2, H, dt);
            HostTensor x_local = filled(dt, plan.recv_rows + 3, H, 0xAB);
            ASSERT_TRUE(ep_dispatch(plan, x_perm.in(), x_local.mut(), comm).ok());
            const std::vector<Source> rows = local_rows(counts, p);
            // Mismatches fail the test without leaving the body: an early return on one rank
            // would leave the others waiting in the next collective.
            for (size_t r = 0; r < rows.size(); ++r) {
              HostTensor src = rows_of(rows[r].rank, rows[r].row + 1, H, dt);
              const bool ok = same_row(x_local, static_cast<int64_t>(r), src, rows[r].row);
              EXPECT_TRUE(ok) << "x_local row " << r << " should be rank " << rows[r].rank
                              << "'s row " << rows[r].row;
              if (!ok) break;
            }
            for (int64_t r = plan.recv_rows; r < plan.recv_rows + 3; ++r) {
              EXPECT_TRUE(row_is(x_local, r, 0xAB)) << "x_local tail row " << r;
            }
            HostTensor y_perm = filled(dt, plan.send_rows + 2, H, 0xCD);
            ASSERT_TRUE(ep_combine(plan, x_local.in(), y_perm.mut(), comm).ok());
            for (int64_t r = 0; r < plan.send_rows; ++r) {
              const bool ok = same_row(y_perm, r, x_perm, r);
              EXPECT_TRUE(ok) << "y_perm row " << r;
              if (!ok) break;
            }
            for (int64_t r = plan.send_rows; r < plan.send_rows + 2; ++r) {
              EXPECT_TRUE(row_is(y_perm, r, 0xCD)) << "y_perm tail row " << r;
            }
          });
        }
      }
    }
  }
}

TEST(Ep, ExchangesInFlightTogetherFinishInAnyOrder) {
  for (int P : rank_counts()) {
    const int64_t E = 2 * P;
    const auto counts = all_counts(Routing::kRandom, P, E);
    on_ranks(P, [&](Communicator& comm) {
      const int p = comm.rank();
      EpPlan plan;
      ASSERT_TRUE(ep_plan(counts_view(counts[p]), comm, &plan).ok());
      HostTensor a = rows_of(p, plan.send_rows, 5, DType::kI32);
      HostTensor b = rows_of(p, plan.send_rows, 3, DType::kBF16);
      HostTensor a_local = filled(DType::kI32, plan.recv_rows, 5, 0);
      HostTensor b_local = filled(DType::kBF16, plan.recv_rows, 3, 0);
      HostTensor a_back = filled(DType::kI32, plan.send_rows, 5, 0);
      EpPending pa, pb, pc;
      ASSERT_TRUE(ep_dispatch_start(plan, a.in(), a_local.mut(), comm, &pa).ok());
      ASSERT_TRUE(ep_dispatch_start(plan, b.in(), b_local.mut(), comm, &pb).ok());
      // A pending that is in use cannot start another exchange (on every rank alike).
      const Status busy = ep_dispatch_start(plan, b.in(), b_local.mut(), comm, &pb);
      EXPECT_NE(busy.message().find("in flight already"), std::string::npos) << busy.message();
      ASSERT_TRUE(ep_wait(&pb).ok());
      ASSERT_TRUE(ep_wait(&pa).ok());
      ASSERT_TRUE(ep_combine_start(plan, a_local.in(), a_back.mut(), comm, &pc).ok());
      ASSERT_TRUE(ep_wait(&pc).ok());
      const std::vector<Source> rows = local_rows(counts, p);
      for (size_t r = 0; r < rows.size(); ++r) {
        const int64_t row = static_cast<int64_t>(r);
        EXPECT_TRUE(same_row(a_local, row, rows_of(rows[r].rank, rows[r].row + 1, 5, DType::kI32),
                             rows[r].row));
        EXPECT_TRUE(same_row(b_local, row, rows_of(rows[r].rank, rows[r].row + 1, 3, DType::kBF16),
                             rows[r].row));
      }
      for (int64_t r = 0; r < plan.send_rows; ++r) EXPECT_TRUE(same_row(a_back, r, a, r));
      const Status idle = ep_wait(&pc);
      EXPECT_NE(idle.message().find("no exchange in flight"), std::string::npos);
    });
  }
}

// Every rank gets an error when any rank's input is bad, naming the argument (and, on the other
// ranks, the rank it came from), and the group still works afterwards.
TEST(EpErrors, ABadInputOnAnyRankIsAnErrorOnEveryRankAndNothingHangs) {
  for (int P : rank_counts()) {
    const int64_t E = 2 * P;
    const auto counts = all_counts(Routing::kRandom, P, E);
    const auto skewed = all_counts(Routing::kSkewed, P, E);
    on_ranks(P, [&](Communicator& comm) {
      const int p = comm.rank();
      const int last = P - 1;
      auto expect_everywhere = [&](const Status& s, const std::string& what, int culprit) {
        test::expect_error_everywhere(comm, s, what, culprit);
      };
      EpPlan plan;
      // Plan: a negative count on the last rank.
      std::vector<int32_t> bad = counts[p];
      if (p == last) bad[1] = -1;
      expect_everywhere(ep_plan(counts_view(bad), comm, &plan), "tokens_per_expert[1]", last);
      if (P > 1) {
        // E not divisible by P, on every rank.
        std::vector<int32_t> odd(static_cast<size_t>(E + 1), 1);
        expect_everywhere(ep_plan(counts_view(odd), comm, &plan), "multiple of the", 0);
        // Ranks that disagree on E.
        std::vector<int32_t> wide(static_cast<size_t>(p == 0 ? 2 * E : E), 1);
        const Status s = ep_plan(counts_view(wide), comm, &plan);
        EXPECT_NE(s.message().find("must be the same on every rank"), std::string::npos)
            << s.message();
      }
      ASSERT_TRUE(ep_plan(counts_view(counts[p]), comm, &plan).ok());
      HostTensor x = rows_of(p, plan.send_rows, 4, DType::kF32);
      HostTensor x_local = filled(DType::kF32, plan.recv_rows, 4, 0);
      // Every rank's sizes, so that every rank takes the same branches below.
      std::vector<int64_t> sends(static_cast<size_t>(P)), recvs(static_cast<size_t>(P));
      ASSERT_TRUE(comm.all_gather(&plan.send_rows, sends.data(), sizeof(int64_t)).ok());
      ASSERT_TRUE(comm.all_gather(&plan.recv_rows, recvs.data(), sizeof(int64_t)).ok());
      // A receive buffer too small on rank 0.
      if (recvs[0] > 0) {
        HostTensor small = filled(DType::kF32, plan.recv_rows - 1, 4, 0);
        expect_everywhere(ep_dispatch(plan, x.in(), p == 0 ? small.mut() : x_local.mut(), comm),
                          "x_local.shape[0]", 0);
      }
      // y_perm too small on the last rank, in a combine.
      if (sends[last] > 0) {
        HostTensor y_small = filled(DType::kF32, plan.send_rows - 1, 4, 0);
        HostTensor y_perm = filled(DType::kF32, plan.send_rows, 4, 0);
        expect_everywhere(
            ep_combine(plan, x_local.in(), p == last ? y_small.mut() : y_perm.mut(), comm),
            "y_perm.shape[0]", last);
      }
      // x_local overlapping x_perm on rank 0.
      if (sends[0] > 0 && recvs[0] > 0) {
        HostTensor both = rows_of(p, plan.send_rows + plan.recv_rows, 4, DType::kF32);
        ConstTensorView sent = both.in();
        sent.shape[0] = plan.send_rows;
        TensorView overlapping = both.mut();
        overlapping.shape[0] = plan.recv_rows;
        expect_everywhere(
            ep_dispatch(plan, p == 0 ? sent : x.in(), p == 0 ? overlapping : x_local.mut(), comm),
            "overlaps x_perm", 0);
      }
      if (P > 1) {
        // Ranks that disagree on H, and on the dtype.
        HostTensor x3 = rows_of(p, plan.send_rows, 3, DType::kF32);
        HostTensor l3 = filled(DType::kF32, plan.recv_rows, 3, 0);
        Status s = p == 0 ? ep_dispatch(plan, x3.in(), l3.mut(), comm)
                          : ep_dispatch(plan, x.in(), x_local.mut(), comm);
        EXPECT_NE(s.message().find("x_perm.shape[1]"), std::string::npos) << s.message();
        EXPECT_NE(s.message().find("must be the same on every rank"), std::string::npos);
        HostTensor xb = rows_of(p, plan.send_rows, 4, DType::kBF16);
        HostTensor lb = filled(DType::kBF16, plan.recv_rows, 4, 0);
        s = p == 0 ? ep_dispatch(plan, xb.in(), lb.mut(), comm)
                   : ep_dispatch(plan, x.in(), x_local.mut(), comm);
        EXPECT_NE(s.message().find("x_perm.dtype = bf16 on rank 0, f32 on rank 1"),
                  std::string::npos)
            << s.message();
        // Plans of different steps: rank 0 holds another one.
        EpPlan other;
        ASSERT_TRUE(ep_plan(counts_view(skewed[p]), comm, &other).ok());
        const EpPlan& mine = p == 0 ? other : plan;
        HostTensor xo = rows_of(p, mine.send_rows, 4, DType::kF32);
        HostTensor lo = filled(DType::kF32, mine.recv_rows, 4, 0);
        s = ep_dispatch(mine, xo.in(), lo.mut(), comm);
        EXPECT_NE(s.message().find("plan.fingerprint"), std::string::npos) << s.message();
      }
      // A plan of another group.
      EpPlan foreign = plan;
      foreign.rank = (p + 1) % (P + 1);
      foreign.num_ranks = P + 1;
      expect_everywhere(ep_dispatch(p == 0 ? foreign : plan, x.in(), x_local.mut(), comm),
                        "another group", 0);
      // After all that, the group works.
      ASSERT_TRUE(ep_dispatch(plan, x.in(), x_local.mut(), comm).ok());
      const std::vector<Source> rows = local_rows(counts, p);
      for (size_t r = 0; r < rows.size(); ++r) {
        EXPECT_TRUE(same_row(x_local, static_cast<int64_t>(r),
                             rows_of(rows[r].rank, rows[r].row + 1, 4, DType::kF32), rows[r].row));
      }
    });
  }
}

TEST(EpEngine, AllReduceSumsInEveryRankAndAnI32OverflowIsAnErrorOnEveryRank) {
  for (int P : rank_counts()) {
    on_ranks(P, [&](Communicator& comm) {
      const int p = comm.rank();
      for (int64_t n : {0, 1, 7, 1000}) {
        std::vector<float> f(static_cast<size_t>(n));
        std::vector<int32_t> i(static_cast<size_t>(n));
        for (int64_t k = 0; k < n; ++k) {
          f[k] = static_cast<float>((p + 1) * k) * 0.5f;
          i[k] = static_cast<int32_t>((p + 1) * k - 3);
        }
        ASSERT_TRUE(comm.all_reduce_sum(f.data(), n, DType::kF32).ok());
        ASSERT_TRUE(comm.all_reduce_sum(i.data(), n, DType::kI32).ok());
        const int64_t ranks = P * (P + 1) / 2;  // sum of p + 1
        for (int64_t k = 0; k < n; ++k) {
          EXPECT_EQ(f[k], static_cast<float>(ranks * k) * 0.5f) << "n=" << n << " k=" << k;
          EXPECT_EQ(i[k], ranks * k - 3 * P) << "n=" << n << " k=" << k;
        }
      }
      if (P > 1) {
        std::vector<int32_t> big = {1, 2, INT_MAX / 2 + 1};
        const Status s = comm.all_reduce_sum(big.data(), 3, DType::kI32);
        EXPECT_NE(s.message().find("data[2]"), std::string::npos) << s.message();
        EXPECT_NE(s.message().find("does not fit int32"), std::string::npos) << s.message();
      }
      std::vector<int32_t> after = {p};
      ASSERT_TRUE(comm.all_reduce_sum(after.data(), 1, DType::kI32).ok());
      EXPECT_EQ(after[0], P * (P - 1) / 2);
    });
  }
}

}  // namespace
}  // namespace moekit
