// The MPI engine of expert parallelism (moekit/ep.h): one process per rank, on one machine or
// many. In the library moekit_mpi (CMake target moekit::mpi), built where MPI is found.
#pragma once

#include <mpi.h>

#include <memory>

#include "moekit/ep.h"

namespace moekit {

// A Communicator over the ranks of `comm` (rank and size as in MPI). Collective over `comm`
// (MPI_Comm_dup): moekit's messages then never meet the caller's. MPI must be initialised;
// destroy the communicator before MPI_Finalize. Rows move by point-to-point messages, one per
// (peer, local expert) block, so that they land regrouped by local expert (see
// bench/results/ for the measurement against MPI_Alltoallv plus a regroup); counts are in rows
// of a contiguous row datatype, so a message may hold up to 2^31 - 1 rows of any size.
Status mpi_communicator(MPI_Comm comm, std::unique_ptr<Communicator>* out);

}  // namespace moekit
