#include "ep_group.h"

#include <fmt/format.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <stdexcept>
#include <thread>

#if MOEKIT_TOOL_MPI
#include "moekit/ep_mpi.h"
#endif

namespace moekit::tools {
namespace {

// Started by mpiexec: Open MPI, MPICH and PMIx launchers each set one of these.
bool started_by_mpiexec() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK");
}

// Each rank's OpenMP threads: OMP_NUM_THREADS, else the machine's cores shared by its ranks. A
// warning when the ranks' threads together exceed the cores.
std::string share_cores(int local_ranks) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (!std::getenv("OMP_NUM_THREADS")) omp_set_num_threads(std::max(1, cores / local_ranks));
  const int threads = omp_get_max_threads();
  if (local_ranks * threads <= cores) return "";
  return fmt::format(
      "warning: {} ranks x {} OpenMP threads on this machine exceed its {} cores: the timings are "
      "of an oversubscribed machine",
      local_ranks, threads, cores);
}

[[noreturn]] void fail(int rank, const std::exception& e) {
  std::fprintf(stderr, "moekit: rank %d: %s\n", rank, e.what());
  std::fflush(stderr);
#if MOEKIT_TOOL_MPI
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) MPI_Abort(MPI_COMM_WORLD, 1);
#endif
  std::_Exit(1);  // the other threads of the group may be waiting for this one
}

void run_mpi(const EpGroupOptions& o, const std::function<void(EpRank&)>& body) {
#if MOEKIT_TOOL_MPI
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  }
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  try {
    if (o.ranks != 0 && o.ranks != size) {
      throw std::runtime_error(fmt::format(
          "--ranks {} with --engine mpi: the group is mpiexec's {} processes", o.ranks, size));
    }
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    int local_ranks = 1;
    MPI_Comm_size(node, &local_ranks);
    MPI_Comm_free(&node);
    std::unique_ptr<Communicator> comm;
    check(mpi_communicator(MPI_COMM_WORLD, &comm));
    MPI_Comm world = MPI_COMM_WORLD;
    EpRank r{*comm, &world, local_ranks, share_cores(local_ranks)};
    body(r);
    comm.reset();
  } catch (const std::exception& e) {
    fail(rank, e);
  }
  MPI_Finalize();
#else
  (void)o;
  (void)body;
  throw CLI::ValidationError("--engine", "mpi: this moekit was built without its MPI engine");
#endif
}

void run_threads(const EpGroupOptions& o, const std::function<void(EpRank&)>& body) {
  const int P = o.ranks == 0 ? 2 : o.ranks;
  std::vector<std::unique_ptr<Communicator>> comms;
  check(thread_communicators(P, &comms));
  std::vector<std::thread> threads;
  for (int p = 0; p < P; ++p) {
    threads.emplace_back([&, p] {
      try {
        EpRank r{*comms[p], nullptr, P, share_cores(P)};
        body(r);
      } catch (const std::exception& e) {
        fail(p, e);
      }
    });
  }
  for (std::thread& t : threads) t.join();
}

}  // namespace

void add_ep_group_options(CLI::App& cmd, EpGroupOptions& o) {
  cmd.add_option("--engine", o.engine,
                 "auto (mpi when started by mpiexec, else threads) | mpi | threads")
      ->check(CLI::IsMember({"auto", "mpi", "threads"}))
      ->capture_default_str();
  cmd.add_option("--ranks", o.ranks,
                 "Ranks of the threads engine (default 2); with mpi, mpiexec's -np decides")
      ->check(CLI::Range(1, 1024));
}

void run_ep_group(const EpGroupOptions& o, const std::function<void(EpRank&)>& body) {
  const bool mpi = o.engine == "mpi" || (o.engine == "auto" && started_by_mpiexec());
  if (mpi) {
    run_mpi(o, body);
  } else {
    run_threads(o, body);
  }
}

void barrier(Communicator& comm) {
  char none = 0;
  std::vector<char> all(static_cast<size_t>(comm.size()));
  check(comm.all_gather(&none, all.data(), 1));
}

void quiet_barrier(EpRank& r) {
#if MOEKIT_TOOL_MPI
  if (r.mpi_comm) {
    MPI_Request request;
    MPI_Ibarrier(*static_cast<MPI_Comm*>(r.mpi_comm), &request);
    for (int done = 0; !done;) {
      MPI_Test(&request, &done, MPI_STATUS_IGNORE);
      if (!done) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return;
  }
#endif
  barrier(r.comm);  // the threads engine's barrier sleeps once it has spun briefly
}

std::vector<Timing> time_collective(Communicator& comm, int warmup, int reps,
                                    const std::vector<std::function<void()>>& fns) {
  std::vector<std::vector<double>> ms(fns.size());
  for (int r = 0; r < warmup + reps; ++r) {
    for (size_t f = 0; f < fns.size(); ++f) {
      barrier(comm);
      const auto t0 = std::chrono::steady_clock::now();
      fns[f]();
      barrier(comm);
      const double t =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (r >= warmup) ms[f].push_back(t);
    }
  }
  std::vector<Timing> out;
  for (auto& m : ms) out.push_back(summarize(std::move(m)));
  return out;
}

}  // namespace moekit::tools
