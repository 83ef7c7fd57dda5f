// The expert-parallel group of the benches that run on P ranks (bench dispatch, bench layer
// --ep): over MPI when the process was started by mpiexec (or --engine mpi), else over P threads
// of this process. Also the barrier-bracketed timing those benches share.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "bench_common.h"
#include "moekit/ep.h"

namespace CLI {
class App;
}

namespace moekit::tools {

struct EpGroupOptions {
  std::string engine = "auto";  // auto | mpi | threads
  int ranks = 0;                // threads engine: P (0: 2); mpi: must be the world's size if set
};

// Adds --engine and --ranks to cmd.
void add_ep_group_options(CLI::App& cmd, EpGroupOptions& o);

// One rank's view of the group.
struct EpRank {
  Communicator& comm;
  void* mpi_comm;       // the MPI engine's MPI_Comm (an MPI_Comm*), else null
  int local_ranks;      // ranks of the group on this machine
  std::string warning;  // "" or a line saying ranks x threads exceed the cores
  bool root() const { return comm.rank() == 0; }
};

// Runs body on every rank of the group. Each rank's OpenMP threads default to cores / local ranks
// (OMP_NUM_THREADS overrides). An exception on any rank ends the whole group with its message
// (MPI_Abort, or the process exits): a bench never leaves ranks waiting.
void run_ep_group(const EpGroupOptions& o, const std::function<void(EpRank&)>& body);

// Every rank waits for all.
void barrier(Communicator& comm);

// The same, but the ranks that wait sleep rather than spin (MPI's own barrier busy-polls), so
// that one rank can time work on every core of the machine while the others wait.
void quiet_barrier(EpRank& r);

// time_interleaved for a group: the functions alternate run by run, each between two barriers, so
// a time is the slowest rank's. Every rank returns its own (nearly equal) times.
std::vector<Timing> time_collective(Communicator& comm, int warmup, int reps,
                                    const std::vector<std::function<void()>>& fns);

}  // namespace moekit::tools
