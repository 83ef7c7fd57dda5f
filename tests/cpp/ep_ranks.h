// Test helper: runs a test body on every rank of an expert-parallel group. The default build
// plays P ranks with P threads over thread_communicators, for each P of rank_counts(); the MPI
// build (MOEKIT_TEST_MPI, run under mpiexec) runs the body once, on this process's rank of
// MPI_COMM_WORLD, and P is the world's size. So one test source checks both engines.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "moekit/ep.h"

namespace moekit::test {

#if MOEKIT_TEST_MPI
Communicator& world();  // tests/cpp/ep_mpi_main.cpp
inline std::vector<int> rank_counts() { return {world().size()}; }
template <class Body>
void on_ranks(int /*P: the world's*/, Body&& body) {
  body(world());
}
#else
inline std::vector<int> rank_counts() { return {1, 2, 3, 4}; }
template <class Body>
void on_ranks(int P, Body&& body) {
  std::vector<std::unique_ptr<Communicator> > comms;
  ASSERT_TRUE(thread_communicators(P, &comms).ok());
  std::vector<std::thread> threads;
  for (int p = 0; p < P; ++p) threads.emplace_back([&, p] { body(*comms[p]); });
  for (std::thread& t : threads) t.join();
}
#endif

// A collective call that must fail on every rank: its message names `what`, and on the ranks
// other than the culprit, the culprit's rank.
inline void expect_error_everywhere(const Communicator& comm, const Status& s,
                                    const std::string& what, int culprit) {
  ASSERT_FALSE(s.ok()) << what;
  EXPECT_NE(s.message().find(what), std::string::npos) << s.message();
  if (comm.rank() != culprit) {
    EXPECT_NE(s.message().find("on rank " + std::to_string(culprit)), std::string::npos)
        << s.message();
  }
}

}  // namespace moekit::test
