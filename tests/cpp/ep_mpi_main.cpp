// main() of the MPI build of the expert-parallel tests (run under mpiexec -n P): every rank runs
// every test in the same order, on a Communicator over MPI_COMM_WORLD. Rank 0 prints the usual
// report; the other ranks print only their failures, marked with their rank. The exit status is
// non-zero on every rank when a test failed on any.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <memory>

#include "ep_ranks.h"
#include "moekit/ep_mpi.h"

namespace moekit::test {
namespace {

std::unique_ptr<Communicator> g_world;

class RankFailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, r.file_name(), r.line_number(),
                 r.summary());
  }

 private:
  int rank_;
};

}  // namespace

Communicator& world() { return *g_world; }

}  // namespace moekit::test

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (moekit::Status s = moekit::mpi_communicator(MPI_COMM_WORLD, &moekit::test::g_world);
      !s.ok()) {
    std::fprintf(stderr, "[rank %d] %s\n", rank, s.message().c_str());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  if (rank != 0) {
    testing::TestEventListeners& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new moekit::test::RankFailurePrinter(rank));
  }
  const int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  moekit::test::g_world.reset();
  MPI_Finalize();
  return any_failed;
}
