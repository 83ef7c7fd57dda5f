// libmoekit_jax_mpi.so: the row exchange of expert parallelism for JAX programs run one process
// per device under mpirun (moekit/jax/ep_mpi.py), on moekit's MPI engine (moekit/ep_mpi.h). A
// library of its own so that libmoekit_jax.so never links MPI; built where MPI is found.
//
// XLA's all_to_all exchanges equal blocks, so on a backend without a ragged all-to-all every
// device sends every peer its worst case. These handlers move only the routed rows: each call
// plans (one all-gather of the counts) and moves the rows with point-to-point messages straight
// into their regrouped places. The result buffers keep the static worst-case shape JAX needs;
// the rows past those received are zeroed, never sent.
//
// Every call is collective over MPI_COMM_WORLD: each process calls the handlers in the same
// order (the layer's data dependencies give that order; moekit.jax.ep_mpi marks the calls as
// side-effecting so that XLA neither drops nor merges them). Each call first checks on every
// rank that the device's index on the mesh axis is its MPI rank, and every moekit op agrees
// before anything moves, so a mismatch or a bad argument is an error on every process, never a
// hang.
#include <mpi.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>

#include "comm/agree.h"
#include "ffi_common.h"
#include "moekit/ep.h"
#include "moekit/ep_mpi.h"

namespace moekit::python {
namespace {

using ffi::AnyBuffer;
using ffi::S32;

// The process's communicator, its plan, and whether MPI was initialised here (then it is
// finalised at exit). XLA may run handlers on any of its threads, one call at a time under mu
// (MPI_THREAD_SERIALIZED).
struct MpiState {
  std::mutex mu;
  std::unique_ptr<Communicator> comm;
  EpPlan plan;
  bool initialised_here = false;
};

MpiState& state() {
  static MpiState* s = new MpiState;  // never destroyed: finalize() tears it down at exit
  return *s;
}

void finalize() {
  MpiState& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.comm.reset();  // MPI_Comm_free, before MPI_Finalize
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (s.initialised_here && !finalized) MPI_Finalize();
}

// The communicator over MPI_COMM_WORLD, MPI initialised first where nobody has (mpi4py, say).
// Called with s.mu held.
Status communicator(MpiState& s, Communicator** out) {
  if (!s.comm) {
    int initialised = 0;
    MPI_Initialized(&initialised);
    if (!initialised) {
      int provided = 0;
      if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
        return Status::internal("moekit.jax.ep_mpi", "MPI_Init_thread failed");
      }
      s.initialised_here = true;
      std::atexit(finalize);
      if (provided < MPI_THREAD_SERIALIZED) {
        return Status::internal("moekit.jax.ep_mpi",
                                "this MPI gives no MPI_THREAD_SERIALIZED; XLA calls the handlers "
                                "from several threads");
      }
    }
    MOEKIT_RETURN_IF_ERROR(mpi_communicator(MPI_COMM_WORLD, &s.comm));
  }
  *out = s.comm.get();
  return {};
}

// Collective: every rank learns whether each device's index on the mesh axis (axis_index, a
// scalar) is its MPI rank, and the axis size the size of MPI_COMM_WORLD. Rows go to MPI ranks,
// so any other mapping would send them to the wrong device.
Status check_axis(Communicator& comm, const char* op, ffi::Buffer<S32> axis_index,
                  int64_t axis_size) {
  Status local = [&]() -> Status {
    if (axis_index.element_count() != 1) {
      return Status::invalid_argument(op, "axis_index", std::to_string(axis_index.element_count()),
                                      "must hold one value");
    }
    if (axis_size != comm.size()) {
      return Status::invalid_argument(
          op, "axis_size", std::to_string(axis_size),
          "the mesh axis must have one device per MPI process, " + std::to_string(comm.size()));
    }
    const int32_t i = axis_index.typed_data()[0];
    if (i != comm.rank()) {
      return Status::invalid_argument(
          op, "axis_index", std::to_string(i),
          "this device's index on the mesh axis must be its process's MPI rank " +
              std::to_string(comm.rank()) + " (build the mesh from jax.devices() in order)");
    }
    return {};
  }();
  return detail::agree(comm, op, local);
}

// What dispatch and combine share, called with s.mu held: the communicator, the axis check,
// the views of the rows in and out, and the plan of the counts (every rank the same
// collectives: the ops agree before they move anything).
struct Exchange {
  Communicator* comm = nullptr;
  ConstTensorView in;
  TensorView out;
};
ffi::Error begin(MpiState& s, const char* op, ffi::Buffer<S32> axis_index, int64_t axis_size,
                 AnyBuffer in, const char* in_name, ffi::Buffer<S32> tokens_per_expert,
                 AnyBuffer out, const char* out_name, Exchange* x) {
  MOEKIT_FFI_TRY(to_error(communicator(s, &x->comm)));
  MOEKIT_FFI_TRY(to_error(check_axis(*x->comm, op, axis_index, axis_size)));
  ConstTensorView counts;
  MOEKIT_FFI_TRY(view_of(in, in_name, &x->in));
  MOEKIT_FFI_TRY(view_of(tokens_per_expert, "tokens_per_expert", &counts));
  MOEKIT_FFI_TRY(view_of(out, out_name, &x->out));
  return to_error(ep_plan(counts, *x->comm, &s.plan));
}

// Rows of each expert to the process holding it, regrouped there by local expert:
//   x_perm [N, H], tokens_per_expert [E] i32 (this process's), axis_index [] i32
//   -> x_local [R, H] (x_perm's dtype; rows past those received 0),
//      local_tokens_per_expert [E_loc] i32 (ragged_dot's group sizes)
ffi::Error dispatch(AnyBuffer x_perm, ffi::Buffer<S32> tokens_per_expert,
                    ffi::Buffer<S32> axis_index, ffi::Result<AnyBuffer> x_local,
                    ffi::Result<ffi::Buffer<S32>> local_tokens_per_expert, int64_t axis_size) {
  constexpr const char* op = "moekit.jax.ep_mpi.dispatch";
  MpiState& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  Exchange x;
  MOEKIT_FFI_TRY(begin(s, op, axis_index, axis_size, x_perm, "x_perm", tokens_per_expert, *x_local,
                       "x_local", &x));
  if (local_tokens_per_expert->element_count() != s.plan.local_tokens_per_expert.size()) {
    // Shapes come from the same program on every rank: every rank stops here alike.
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": local_tokens_per_expert must hold E / P values");
  }
  MOEKIT_FFI_TRY(to_error(ep_dispatch(s.plan, x.in, x.out, *x.comm)));
  zero_rows_from(*x_local, s.plan.recv_rows);
  std::memcpy(local_tokens_per_expert->typed_data(), s.plan.local_tokens_per_expert.data(),
              s.plan.local_tokens_per_expert.size() * sizeof(int32_t));
  return ffi::Error::Success();
}

// The inverse: the local experts' rows back to the processes they came from, in x_perm's order.
//   y_local [R, H], tokens_per_expert [E] i32 (as given to dispatch), axis_index [] i32
//   -> y_perm [N, H] (rows past the routed ones 0)
ffi::Error combine(AnyBuffer y_local, ffi::Buffer<S32> tokens_per_expert,
                   ffi::Buffer<S32> axis_index, ffi::Result<AnyBuffer> y_perm, int64_t axis_size) {
  MpiState& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  Exchange x;
  MOEKIT_FFI_TRY(begin(s, "moekit.jax.ep_mpi.combine", axis_index, axis_size, y_local, "y_local",
                       tokens_per_expert, *y_perm, "y_perm", &x));
  MOEKIT_FFI_TRY(to_error(ep_combine(s.plan, x.in, x.out, *x.comm)));
  zero_rows_from(*y_perm, s.plan.send_rows);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kDispatch, dispatch,
                       ffi::Ffi::Bind()
                           .Arg<AnyBuffer>()
                           .Arg<ffi::Buffer<S32>>()
                           .Arg<ffi::Buffer<S32>>()
                           .Ret<AnyBuffer>()
                           .Ret<ffi::Buffer<S32>>()
                           .Attr<int64_t>("axis_size"));
XLA_FFI_DEFINE_HANDLER(kCombine, combine,
                       ffi::Ffi::Bind()
                           .Arg<AnyBuffer>()
                           .Arg<ffi::Buffer<S32>>()
                           .Arg<ffi::Buffer<S32>>()
                           .Ret<AnyBuffer>()
                           .Attr<int64_t>("axis_size"));

constexpr Target kTargets[] = {
    {"moekit_ep_mpi_dispatch", "cpu", kDispatch},
    {"moekit_ep_mpi_combine", "cpu", kCombine},
};

}  // namespace
}  // namespace moekit::python

// The library's C interface (moekit/jax/ep_mpi.py declares the same with ctypes): its handlers,
// as moekit_ffi_targets gives libmoekit_jax.so's.
extern "C" __attribute__((visibility("default"))) int64_t moekit_ffi_mpi_targets(
    const moekit::python::Target** targets) {
  *targets = moekit::python::kTargets;
  return static_cast<int64_t>(std::size(moekit::python::kTargets));
}
