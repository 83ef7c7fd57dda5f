// The installed moekit::mpi target: each of the ranks sends rows to the others' experts and takes
// them back; the rows must come back unchanged. Run under mpiexec by tests/install/check.
#include <moekit/ep_mpi.h>
#include <mpi.h>

#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, wrong = 0;
  {
    std::unique_ptr<moekit::Communicator> comm;
    moekit::Status s = moekit::mpi_communicator(MPI_COMM_WORLD, &comm);
    rank = comm ? comm->rank() : 0;
    const int P = comm ? comm->size() : 1;
    // Two experts per rank; rank r sends r + e + 1 rows to expert e.
    std::vector<int32_t> counts(2 * static_cast<size_t>(P));
    int64_t rows = 0;
    for (size_t e = 0; e < counts.size(); ++e) rows += counts[e] = rank + static_cast<int>(e) + 1;
    moekit::EpPlan plan;
    if (s.ok()) {
      s = moekit::ep_plan(moekit::ConstTensorView(counts.data(), moekit::DType::kI32,
                                                  {static_cast<int64_t>(counts.size())}),
                          *comm, &plan);
    }
    const int64_t H = 3;
    std::vector<float> x(rows * H), local(plan.recv_rows * H + 1), back(rows * H, -1.0f);
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(rank * 1000 + i);
    if (s.ok()) {
      s = moekit::ep_dispatch(
          plan, moekit::ConstTensorView(x.data(), moekit::DType::kF32, {rows, H}),
          moekit::TensorView(local.data(), moekit::DType::kF32, {plan.recv_rows, H}), *comm);
    }
    if (s.ok()) {
      s = moekit::ep_combine(
          plan, moekit::ConstTensorView(local.data(), moekit::DType::kF32, {plan.recv_rows, H}),
          moekit::TensorView(back.data(), moekit::DType::kF32, {rows, H}), *comm);
    }
    if (!s.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, s.message().c_str());
      wrong = 1;
    }
    for (size_t i = 0; i < x.size(); ++i) wrong += back[i] != x[i];
  }
  int all = 0;
  MPI_Allreduce(&wrong, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) std::printf("moekit consumer: dispatch and combine over MPI: %d wrong\n", all);
  MPI_Finalize();
  return all == 0 ? 0 : 1;
}
