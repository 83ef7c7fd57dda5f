// Expert parallelism (SPEC.md section 4): the ragged all-to-all that sends each expert's rows to
// the rank holding that expert, and brings the results back.
//
// P ranks; rank p holds the E_loc = E / P consecutive experts p*E_loc .. (p+1)*E_loc - 1 and its
// own T_p tokens (any number, 0 included). A row is one [H] row of any dtype; the ops here only
// move rows, so they take every dtype and never change a bit.
//
//   tokens_per_expert [E]  --ep_plan-->  EpPlan (counts, offsets, local group sizes)
//   x_perm [N_p, H]        --ep_dispatch-->  x_local [R_p, H]   (local-expert-major)
//   y_local [R_p, H]       --ep_combine--->  y_perm [N_p, H]    (back in x_perm's order)
//
// x_perm is permute's output on this rank: expert-major, so the rows for each destination rank
// are contiguous. x_local holds, for local expert 0, the rows from rank 0, then rank 1, ...; then
// local expert 1, and so on ([local expert][source rank]), each source's rows in its own order:
// the plan's local_tokens_per_expert are ragged_dot's group sizes for the local weights.
// ep_combine is the exact inverse row permutation, so each op is the other's gradient.
//
// Every op here is collective: each rank of the communicator calls it, in the same order as the
// others. Every op checks its arguments, then agrees with the other ranks before anything moves:
// an error on any rank (a bad argument, ranks that disagree on E, H or the dtype, a buffer
// smaller than the plan needs) is returned on every rank, naming the rank and the argument, and
// no rank is left waiting and no row is written.
//
// Engines: thread_communicators (threads of one process; tests, one machine without mpirun) and
// mpi_communicator (moekit/ep_mpi.h; one process per rank, any number of machines). The plan and
// the block layout are shared; only the row exchange is per engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "moekit/status.h"
#include "moekit/view.h"

namespace moekit {

// One contiguous block of `rows` rows (row_bytes each) that an exchange sends to, or receives
// from, `peer`.
struct SendBlock {
  int peer = 0;
  const void* data = nullptr;
  int64_t rows = 0;
};
struct RecvBlock {
  int peer = 0;
  void* data = nullptr;
  int64_t rows = 0;
};

// The ranks of an expert-parallel group, and the few collectives the ep_* ops are built from.
// Implement it to run moekit over another transport. Every method is collective (each rank
// calls it, in the same order as the others) and returns an error rather than throwing; an
// engine error is reported on the rank that sees it (the ep_* ops agree on their inputs first,
// so a well-formed call sees none).
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;            // P
  virtual const char* engine() const = 0;  // "threads", "mpi"

  // recv [P * bytes]: rank q's `bytes` bytes of send at q * bytes, on every rank.
  virtual Status all_gather(const void* send, void* recv, size_t bytes) = 0;
  // In place: data [n] f32 or i32 becomes its sum over the ranks, the same bits on every rank.
  virtual Status all_reduce_sum(void* data, int64_t n, DType dtype) = 0;
  // Starts moving rows. The i-th send block to peer q lands in the i-th receive block that q
  // lists from this rank (blocks to and from this rank itself included), whose rows must be
  // equal. Blocks with 0 rows may be left out; both sides must then leave them out. Until
  // exchange_wait returns, the send blocks must stay unchanged and the receive blocks unread.
  // The engine copies the lists: they may go once this returns. `ticket` names the exchange.
  virtual Status exchange_start(size_t row_bytes, std::span<const SendBlock> send,
                                std::span<const RecvBlock> recv, int64_t* ticket) = 0;
  // Waits until every block of exchange `ticket` has arrived and every send block has been
  // read. Exchanges may be waited for in any order; at most kMaxExchangesInFlight are started
  // and not yet waited for on a rank.
  virtual Status exchange_wait(int64_t ticket) = 0;

  static constexpr int kMaxExchangesInFlight = 8;
};

// P communicators of one process, linked to each other: give communicator p to the thread that
// plays rank p. Each may be used by one thread at a time. The set stays usable as long as any of
// them lives.
Status thread_communicators(int num_ranks, std::vector<std::unique_ptr<Communicator>>* out);

// What every rank needs to know to move its rows: computed once per step by ep_plan, then used
// by dispatch, combine and both backwards (the only host-side state they need). Rows are
// counted in rows, offsets in rows from the start of the buffer.
struct EpPlan {
  int num_ranks = 0;  // P
  int rank = 0;       // p, this rank
  int64_t num_experts = 0;
  int64_t num_local_experts = 0;  // E_loc = E / P

  // Send side (this rank's x_perm): rows for rank q at send_offsets[q], send_counts[q] of them;
  // expert e's rows at expert_offsets[e]. send_rows = their sum (the rows of x_perm used).
  std::vector<int32_t> tokens_per_expert;          // [E] as given to ep_plan
  std::vector<int64_t> expert_offsets;             // [E]
  std::vector<int64_t> send_counts, send_offsets;  // [P]
  int64_t send_rows = 0;

  // Receive side (x_local): recv_tokens_per_expert[q * E_loc + j] rows come from rank q for
  // local expert j, and sit at local_offsets[q * E_loc + j] of x_local; recv_counts[q] rows from
  // rank q in all, at recv_offsets[q] of the exchange as a whole (the order a plain all-to-all
  // would give, [source rank][local expert]). local_tokens_per_expert[j]: the rows of local
  // expert j, summed over the sources (ragged_dot's group sizes). recv_rows: their sum.
  std::vector<int32_t> recv_tokens_per_expert;     // [P, E_loc]
  std::vector<int64_t> local_offsets;              // [P, E_loc]
  std::vector<int64_t> recv_counts, recv_offsets;  // [P]
  std::vector<int32_t> local_tokens_per_expert;    // [E_loc]
  int64_t recv_rows = 0;

  // Every rank's tokens_per_expert ([P, E], rank q's in row q), and their sum over the ranks
  // ([E]: the load of each expert over the whole group).
  std::vector<int32_t> all_tokens_per_expert;
  std::vector<int64_t> global_tokens_per_expert;

  // The same on every rank for the plans of one ep_plan call: dispatch and combine refuse, on
  // every rank, to run when the ranks hold plans of different steps.
  uint64_t fingerprint = 0;
};

// The plan, from this rank's rows per expert.
//   tokens_per_expert  [E] i32, each >= 0: permute's output on this rank (padding and capacity
//                      included: whatever rows x_perm holds per expert)
// E must be divisible by P, and equal on every rank. Rows per local expert, summed over the
// ranks, must fit int32 (ragged_dot's group sizes). Two small collectives: an agreement on E,
// then one all-gather of the counts. `plan`'s vectors keep their capacity from call to call.
Status ep_plan(ConstTensorView tokens_per_expert, Communicator& comm, EpPlan* plan);

// An exchange in flight between a *_start and ep_wait. Reuse one across steps: its block lists
// keep their capacity, so a step allocates nothing.
struct EpPending {
  Communicator* comm = nullptr;
  int64_t ticket = -1;  // -1: nothing in flight
  std::vector<SendBlock> send;
  std::vector<RecvBlock> recv;
};

// Dispatch: rows to the ranks holding their experts, regrouped by local expert on arrival.
//   x_perm   [N_p, H], any dtype, rows contiguous, N_p >= plan.send_rows (rows past it stay)
//   x_local  [R_p, H], x_perm's dtype, rows contiguous, R_p >= plan.recv_rows (rows past it are
//            left as they are); must not overlap x_perm
// H and the dtype must agree on every rank.
Status ep_dispatch(const EpPlan& plan, ConstTensorView x_perm, TensorView x_local,
                   Communicator& comm);
// Combine: the inverse. y_perm's rows past plan.send_rows are left as they are.
//   y_local  [R_p, H], R_p >= plan.recv_rows
//   y_perm   [N_p, H], y_local's dtype, N_p >= plan.send_rows; must not overlap y_local
Status ep_combine(const EpPlan& plan, ConstTensorView y_local, TensorView y_perm,
                  Communicator& comm);

// Split-phase forms: start, compute something else, then ep_wait. Between the two, the input
// must stay unchanged and the output unread. A start that fails leaves nothing in flight.
Status ep_dispatch_start(const EpPlan& plan, ConstTensorView x_perm, TensorView x_local,
                         Communicator& comm, EpPending* pending);
Status ep_combine_start(const EpPlan& plan, ConstTensorView y_local, TensorView y_perm,
                        Communicator& comm, EpPending* pending);
Status ep_wait(EpPending* pending);

// ---------------------------------------------------------------------------------------------
// Exchanges of fixed-size blocks. Where the row exchange has to be an all-to-all of equal blocks
// (XLA's all_to_all, on backends without a ragged all-to-all), every rank sends every peer a
// block of C rows, of which only the first carry rows, and the receiver regroups what arrives.
// These four ops are the layouts on either side of such an exchange; the exchange is the
// caller's. They need no communicator and no plan: the counts say where every row goes. Each is
// a pure row permutation plus zero rows, and each pair is the other's gradient. Dropless, C
// must hold the most rows one rank can send one peer (all of its N); with a capacity, less.
//
//   x_perm [N, H]  --ep_pack-->     send [P, C, H]    block q: the rows of peer q's experts
//   recv [P, C, H] --ep_regroup-->  x_local [R, H]    [local expert][source rank], then 0 rows
//   y_local [R, H] --ep_ungroup-->  [P, C, H]         back in recv's layout
//   [P, C, H]      --ep_unpack-->   y_perm [N, H]     back in x_perm's layout
//
// Counts are read from host memory; any that do not fit (negative, more rows than a block or a
// buffer holds) are an error before anything is written.

// send [q, i] = x_perm's i-th row of peer q's experts (experts q*E_loc .. (q+1)*E_loc - 1, in
// order), for i below their rows; every other row of send is 0.
//   x_perm             [N, H] any dtype, rows in the order tokens_per_expert gives
//   tokens_per_expert  [E] i32, E = P * E_loc (P = send.shape[0])
//   send               [P, C, H] x_perm's dtype
Status ep_pack(ConstTensorView x_perm, ConstTensorView tokens_per_expert, TensorView send);
// The inverse: x_perm's rows back from the blocks; rows past sum(tokens_per_expert) are 0.
Status ep_unpack(ConstTensorView send, ConstTensorView tokens_per_expert, TensorView x_perm);

// x_local = local expert 0's rows from source 0, 1, ..., then local expert 1's, ...; then 0 rows.
// Block q of recv holds source q's rows for local expert 0, then 1, ... (as ep_pack left them).
//   recv                    [P, C, H] any dtype
//   recv_tokens_per_expert  [P, E_loc] i32: rows source q sent for local expert j
//   x_local                 [R, H] recv's dtype, R >= the rows received (P * C always will do)
Status ep_regroup(ConstTensorView recv, ConstTensorView recv_tokens_per_expert, TensorView x_local);
// The inverse: the blocks back from x_local's rows; each block's unused rows are 0.
Status ep_ungroup(ConstTensorView x_local, ConstTensorView recv_tokens_per_expert, TensorView recv);

}  // namespace moekit
