// Expert-parallel plan, dispatch and combine (SPEC.md section 4): the part every engine shares.
// The plan turns every rank's counts into offsets; dispatch and combine turn the plan into
// block lists, one block per (rank, expert) pair that has rows, and hand them to the engine,
// which moves each block straight to where it belongs: no staging buffer, no regroup pass.
#include "moekit/ep.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "check.h"
#include "comm/agree.h"

namespace moekit {
namespace {

using detail::agree;
using detail::AgreedValue;
using detail::check_view;
using detail::shape_str;

// FNV-1a over the gathered counts: equal on every rank after one ep_plan call.
uint64_t fingerprint(const std::vector<int32_t>& counts) {
  uint64_t h = 1469598103934665603ull;
  for (int32_t c : counts) {
    h ^= static_cast<uint32_t>(c);
    h *= 1099511628211ull;
  }
  return h;
}

// The plan fits this communicator and is whole (as ep_plan leaves it).
Status check_plan(const char* op, const EpPlan& plan, const Communicator& comm) {
  const int P = comm.size();
  if (plan.num_ranks != P || plan.rank != comm.rank()) {
    return Status::invalid_argument(
        op, "plan", fmt::format("rank {} of {}", plan.rank, plan.num_ranks),
        fmt::format("was made for another group than this rank {} of {} (call ep_plan)",
                    comm.rank(), P));
  }
  const auto E = static_cast<size_t>(plan.num_experts);
  const auto PE = static_cast<size_t>(P) * static_cast<size_t>(plan.num_local_experts);
  if (plan.num_experts != P * plan.num_local_experts || plan.tokens_per_expert.size() != E ||
      plan.expert_offsets.size() != E || plan.recv_tokens_per_expert.size() != PE ||
      plan.local_offsets.size() != PE ||
      plan.local_tokens_per_expert.size() != static_cast<size_t>(plan.num_local_experts)) {
    return Status::invalid_argument(op, "plan", fmt::format("E = {}", plan.num_experts),
                                    "is not a plan made by ep_plan");
  }
  return {};
}

// A [rows, H] buffer of contiguous rows, with at least `need` rows; *row_bytes = H * size.
Status check_rows(const char* op, const char* name, const ConstTensorView& v, int64_t need,
                  const char* need_what, int64_t* row_bytes) {
  MOEKIT_RETURN_IF_ERROR(check_view(op, name, v, 2));
  if (v.shape[0] > 1 && v.stride[0] != v.shape[1]) {
    return Status::invalid_argument(op, fmt::format("{}.stride[0]", name),
                                    std::to_string(v.stride[0]),
                                    fmt::format("rows must be contiguous (= H = {})", v.shape[1]));
  }
  int64_t bytes = 0;
  if (!detail::mul_fits(v.shape[1], static_cast<int64_t>(dtype_size(v.dtype)), row_bytes) ||
      !detail::mul_fits(v.shape[0], *row_bytes, &bytes)) {
    return Status::invalid_argument(op, fmt::format("{}.shape", name), shape_str(v),
                                    "its byte count does not fit int64");
  }
  if (v.shape[0] < need) {
    return Status::invalid_argument(op, fmt::format("{}.shape[0]", name),
                                    std::to_string(v.shape[0]),
                                    fmt::format("must be >= {} = {}", need_what, need));
  }
  return {};
}

// Dispatch (to_experts) or combine: checks, agreement, block lists, engine start.
Status start(const char* op, bool to_experts, const EpPlan& plan, const ConstTensorView& in,
             const TensorView& out, Communicator& comm, EpPending* pending) {
  const char* in_name = to_experts ? "x_perm" : "y_local";
  const char* out_name = to_experts ? "x_local" : "y_perm";
  const char* send_what = "plan.send_rows";
  const char* recv_what = "plan.recv_rows";
  int64_t row_bytes = 0;
  Status local = [&]() -> Status {
    if (!pending) return Status::invalid_argument(op, "pending", "null", "must point to one");
    if (pending->ticket != -1) {
      return Status::invalid_argument(op, "pending", fmt::format("ticket {}", pending->ticket),
                                      "has an exchange in flight already (call ep_wait)");
    }
    MOEKIT_RETURN_IF_ERROR(check_plan(op, plan, comm));
    int64_t out_row_bytes = 0;
    MOEKIT_RETURN_IF_ERROR(check_rows(op, in_name, in, to_experts ? plan.send_rows : plan.recv_rows,
                                      to_experts ? send_what : recv_what, &row_bytes));
    MOEKIT_RETURN_IF_ERROR(check_rows(op, out_name, out,
                                      to_experts ? plan.recv_rows : plan.send_rows,
                                      to_experts ? recv_what : send_what, &out_row_bytes));
    MOEKIT_RETURN_IF_ERROR(detail::check_same_dtype(op, out_name, out.dtype, in_name, in.dtype));
    MOEKIT_RETURN_IF_ERROR(detail::check_dim(op, out_name, out, 1, in.shape[1],
                                             to_experts ? "x_perm.shape[1]" : "y_local.shape[1]"));
    // The rows that move must not overlap (a row could be overwritten before it is sent).
    ConstTensorView moving_in = in, moving_out = out;
    moving_in.shape[0] = to_experts ? plan.send_rows : plan.recv_rows;
    moving_out.shape[0] = to_experts ? plan.recv_rows : plan.send_rows;
    MOEKIT_RETURN_IF_ERROR(
        detail::check_disjoint(op, {{out_name, moving_out}}, {{in_name, moving_in}}));
    return {};
  }();
  const AgreedValue values[] = {
      {"plan.fingerprint", local.ok() ? static_cast<int64_t>(plan.fingerprint) : 0},
      {to_experts ? "x_perm.shape[1]" : "y_local.shape[1]", local.ok() ? in.shape[1] : 0},
      {to_experts ? "x_perm.dtype" : "y_local.dtype",
       local.ok() ? static_cast<int64_t>(in.dtype) : 0, true}};
  MOEKIT_RETURN_IF_ERROR(agree(comm, op, local, values));

  const int64_t El = plan.num_local_experts;
  const auto* src = static_cast<const std::byte*>(in.data);
  auto* dst = static_cast<std::byte*>(out.data);
  std::vector<SendBlock>& send = pending->send;
  std::vector<RecvBlock>& recv = pending->recv;
  send.clear();
  recv.clear();
  // The permuted side (x_perm, y_perm): one block per expert with rows, to or from its rank.
  for (int64_t e = 0; e < plan.num_experts; ++e) {
    const int32_t rows = plan.tokens_per_expert[static_cast<size_t>(e)];
    if (rows == 0) continue;
    const int peer = static_cast<int>(e / El);
    const int64_t at = plan.expert_offsets[static_cast<size_t>(e)] * row_bytes;
    if (to_experts) {
      send.push_back({peer, src + at, rows});
    } else {
      recv.push_back({peer, dst + at, rows});
    }
  }
  // The grouped side (x_local, y_local): one block per (source rank, local expert) with rows.
  for (int q = 0; q < plan.num_ranks; ++q) {
    for (int64_t j = 0; j < El; ++j) {
      const size_t qj = static_cast<size_t>(q * El + j);
      const int32_t rows = plan.recv_tokens_per_expert[qj];
      if (rows == 0) continue;
      const int64_t at = plan.local_offsets[qj] * row_bytes;
      if (to_experts) {
        recv.push_back({q, dst + at, rows});
      } else {
        send.push_back({q, src + at, rows});
      }
    }
  }
  int64_t ticket = -1;
  MOEKIT_RETURN_IF_ERROR(comm.exchange_start(static_cast<size_t>(row_bytes), send, recv, &ticket));
  pending->comm = &comm;
  pending->ticket = ticket;
  return {};
}

}  // namespace

Status ep_plan(ConstTensorView tokens_per_expert, Communicator& comm, EpPlan* plan) {
  constexpr const char* op = "ep_plan";
  const int P = comm.size(), me = comm.rank();
  int64_t E = 0;
  Status local = [&]() -> Status {
    if (!plan) return Status::invalid_argument(op, "plan", "null", "must point to an EpPlan");
    MOEKIT_RETURN_IF_ERROR(check_view(op, "tokens_per_expert", tokens_per_expert, 1));
    MOEKIT_RETURN_IF_ERROR(
        detail::check_dtype(op, "tokens_per_expert", tokens_per_expert.dtype, DType::kI32));
    E = tokens_per_expert.shape[0];
    if (E < 1 || E % P != 0) {
      return Status::invalid_argument(
          op, "tokens_per_expert.shape[0]", std::to_string(E),
          fmt::format("the experts E must be a positive multiple of the {} ranks", P));
    }
    for (int64_t e = 0; e < E; ++e) {
      const int32_t c =
          static_cast<const int32_t*>(tokens_per_expert.data)[e * tokens_per_expert.stride[0]];
      if (c < 0) {
        return Status::invalid_argument(op, fmt::format("tokens_per_expert[{}]", e),
                                        std::to_string(c), "rows per expert must be >= 0");
      }
    }
    return {};
  }();
  const AgreedValue values[] = {{"tokens_per_expert.shape[0] (E)", local.ok() ? E : 0}};
  MOEKIT_RETURN_IF_ERROR(agree(comm, op, local, values));

  EpPlan& pl = *plan;
  const int64_t El = E / P;
  pl.tokens_per_expert.resize(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    pl.tokens_per_expert[static_cast<size_t>(e)] =
        static_cast<const int32_t*>(tokens_per_expert.data)[e * tokens_per_expert.stride[0]];
  }
  pl.num_ranks = P;
  pl.rank = me;
  pl.num_experts = E;
  pl.num_local_experts = El;
  pl.all_tokens_per_expert.resize(static_cast<size_t>(P * E));
  MOEKIT_RETURN_IF_ERROR(comm.all_gather(pl.tokens_per_expert.data(),
                                         pl.all_tokens_per_expert.data(),
                                         static_cast<size_t>(E) * sizeof(int32_t)));
  const auto at = [&](int q, int64_t e) {
    return pl.all_tokens_per_expert[static_cast<size_t>(q * E + e)];
  };
  // Every rank checks every expert alike, so that all return the same answer.
  pl.global_tokens_per_expert.assign(static_cast<size_t>(E), 0);
  for (int q = 0; q < P; ++q) {
    for (int64_t e = 0; e < E; ++e) pl.global_tokens_per_expert[static_cast<size_t>(e)] += at(q, e);
  }
  for (int64_t e = 0; e < E; ++e) {
    const int64_t g = pl.global_tokens_per_expert[static_cast<size_t>(e)];
    if (g > std::numeric_limits<int32_t>::max()) {
      return Status::invalid_argument(
          op, fmt::format("the rows of expert {} over all ranks", e), std::to_string(g),
          "must fit int32 (they are ragged_dot's group size on the rank holding it)");
    }
  }

  // Send side.
  pl.expert_offsets.resize(static_cast<size_t>(E));
  pl.send_counts.assign(static_cast<size_t>(P), 0);
  pl.send_offsets.resize(static_cast<size_t>(P));
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (e % El == 0) pl.send_offsets[static_cast<size_t>(e / El)] = row;
    pl.expert_offsets[static_cast<size_t>(e)] = row;
    row += at(me, e);
    pl.send_counts[static_cast<size_t>(e / El)] += at(me, e);
  }
  pl.send_rows = row;

  // Receive side: x_local is [local expert][source rank].
  pl.recv_tokens_per_expert.resize(static_cast<size_t>(P * El));
  pl.local_offsets.resize(static_cast<size_t>(P * El));
  pl.local_tokens_per_expert.resize(static_cast<size_t>(El));
  pl.recv_counts.assign(static_cast<size_t>(P), 0);
  pl.recv_offsets.resize(static_cast<size_t>(P));
  row = 0;
  for (int64_t j = 0; j < El; ++j) {
    for (int q = 0; q < P; ++q) {
      const int32_t c = at(q, me * El + j);
      pl.recv_tokens_per_expert[static_cast<size_t>(q * El + j)] = c;
      pl.local_offsets[static_cast<size_t>(q * El + j)] = row;
      pl.recv_counts[static_cast<size_t>(q)] += c;
      row += c;
    }
    pl.local_tokens_per_expert[static_cast<size_t>(j)] =
        static_cast<int32_t>(pl.global_tokens_per_expert[static_cast<size_t>(me * El + j)]);
  }
  pl.recv_rows = row;
  int64_t offset = 0;
  for (int q = 0; q < P; ++q) {
    pl.recv_offsets[static_cast<size_t>(q)] = offset;
    offset += pl.recv_counts[static_cast<size_t>(q)];
  }
  pl.fingerprint = fingerprint(pl.all_tokens_per_expert);
  return {};
}

Status ep_dispatch_start(const EpPlan& plan, ConstTensorView x_perm, TensorView x_local,
                         Communicator& comm, EpPending* pending) {
  return start("ep_dispatch", true, plan, x_perm, x_local, comm, pending);
}

Status ep_combine_start(const EpPlan& plan, ConstTensorView y_local, TensorView y_perm,
                        Communicator& comm, EpPending* pending) {
  return start("ep_combine", false, plan, y_local, y_perm, comm, pending);
}

Status ep_wait(EpPending* pending) {
  if (!pending || !pending->comm || pending->ticket < 0) {
    return Status::invalid_argument("ep_wait", "pending", pending ? "idle" : "null",
                                    "has no exchange in flight");
  }
  const int64_t ticket = pending->ticket;
  pending->ticket = -1;
  return pending->comm->exchange_wait(ticket);
}

Status ep_dispatch(const EpPlan& plan, ConstTensorView x_perm, TensorView x_local,
                   Communicator& comm) {
  EpPending pending;
  MOEKIT_RETURN_IF_ERROR(ep_dispatch_start(plan, x_perm, x_local, comm, &pending));
  return ep_wait(&pending);
}

Status ep_combine(const EpPlan& plan, ConstTensorView y_local, TensorView y_perm,
                  Communicator& comm) {
  EpPending pending;
  MOEKIT_RETURN_IF_ERROR(ep_combine_start(plan, y_local, y_perm, comm, &pending));
  return ep_wait(&pending);
}

// ---------------------------------------------------------------------------------------------
// Fixed-size exchanges: the layouts on either side.

namespace {

// Rows that move between the flat side (x_perm, x_local: [rows, H]) and the blocked side
// ([P, C, H], seen as P * C rows).
struct Run {
  int64_t flat, blocked, rows;
};

// What one of the four ops moves: its runs, and the rows of its destination no run covers,
// which it zeroes.
struct Moves {
  std::vector<Run> runs;
  std::vector<std::pair<int64_t, int64_t>> zero;  // [first, last) rows of the destination
};

// A [rows, H] buffer of contiguous rows; *row_bytes = H * the dtype's size.
Status check_flat(const char* op, const char* name, const ConstTensorView& v, int64_t* row_bytes) {
  return check_rows(op, name, v, 0, "", row_bytes);
}

// [P, C, H] of contiguous rows and blocks, H and the dtype those of `flat`.
Status check_blocked(const char* op, const char* name, const ConstTensorView& v,
                     const ConstTensorView& flat, const char* flat_name) {
  MOEKIT_RETURN_IF_ERROR(check_view(op, name, v, 3));
  MOEKIT_RETURN_IF_ERROR(detail::check_same_dtype(op, name, v.dtype, flat_name, flat.dtype));
  MOEKIT_RETURN_IF_ERROR(detail::check_dim(op, name, v, 2, flat.shape[1],
                                           fmt::format("{}.shape[1]", flat_name).c_str()));
  int64_t rows = 0, bytes = 0;
  if (!detail::mul_fits(v.shape[0], v.shape[1], &rows) ||
      !detail::mul_fits(rows, v.shape[2] * static_cast<int64_t>(dtype_size(v.dtype)), &bytes)) {
    return Status::invalid_argument(op, fmt::format("{}.shape", name), shape_str(v),
                                    "its byte count does not fit int64");
  }
  if ((v.shape[1] > 1 && v.stride[1] != v.shape[2]) ||
      (v.shape[0] > 1 && v.stride[0] != v.shape[1] * v.shape[2])) {
    return Status::invalid_argument(op, fmt::format("{}.stride", name),
                                    fmt::format("[{}, {}, 1]", v.stride[0], v.stride[1]),
                                    "blocks and rows must be contiguous");
  }
  return {};
}

// The counts of one side, as int64, checked >= 0: [E] (tokens_per_expert) or [P, E_loc].
Status read_counts(const char* op, const char* name, const ConstTensorView& v, int rank,
                   std::vector<int64_t>* out) {
  MOEKIT_RETURN_IF_ERROR(check_view(op, name, v, rank));
  MOEKIT_RETURN_IF_ERROR(detail::check_dtype(op, name, v.dtype, DType::kI32));
  out->clear();
  const int64_t rows = rank == 1 ? 1 : v.shape[0], cols = v.shape[rank - 1];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int32_t x = static_cast<const int32_t*>(
          v.data)[(rank == 1 ? 0 : r * v.stride[0]) + c * v.stride[rank - 1]];
      if (x < 0) {
        return Status::invalid_argument(
            op, rank == 1 ? fmt::format("{}[{}]", name, c) : fmt::format("{}[{}, {}]", name, r, c),
            std::to_string(x), "rows must be >= 0");
      }
      out->push_back(x);
    }
  }
  return {};
}

// pack / unpack: one run per peer (its experts' rows are contiguous on both sides).
Status pack_moves(const char* op, const ConstTensorView& tpe, int64_t P, int64_t C,
                  int64_t flat_rows, bool to_blocked, Moves* m) {
  std::vector<int64_t> counts;
  MOEKIT_RETURN_IF_ERROR(read_counts(op, "tokens_per_expert", tpe, 1, &counts));
  const int64_t E = static_cast<int64_t>(counts.size());
  if (P < 1 || E % P != 0) {
    return Status::invalid_argument(
        op, "tokens_per_expert.shape[0]", std::to_string(E),
        fmt::format("the experts must be a multiple of the {} blocks (ranks)", P));
  }
  const int64_t El = E / P;
  m->runs.clear();
  m->zero.clear();
  int64_t flat = 0;
  for (int64_t q = 0; q < P; ++q) {
    int64_t rows = 0;
    for (int64_t j = 0; j < El; ++j) rows += counts[static_cast<size_t>(q * El + j)];
    if (rows > C) {
      return Status::invalid_argument(op, fmt::format("the rows for rank {}", q),
                                      std::to_string(rows),
                                      fmt::format("more than a block holds (C = {})", C));
    }
    if (rows > 0) m->runs.push_back({flat, q * C, rows});
    if (to_blocked && rows < C) m->zero.emplace_back(q * C + rows, (q + 1) * C);
    flat += rows;
  }
  if (flat > flat_rows) {
    return Status::invalid_argument(op, "sum(tokens_per_expert)", std::to_string(flat),
                                    fmt::format("more than x_perm's {} rows", flat_rows));
  }
  if (!to_blocked && flat < flat_rows) m->zero.emplace_back(flat, flat_rows);
  return {};
}

// regroup / ungroup: one run per (source, local expert), flat side local-expert-major.
Status regroup_moves(const char* op, const ConstTensorView& rtpe, int64_t P, int64_t C,
                     int64_t flat_rows, bool to_blocked, Moves* m) {
  std::vector<int64_t> counts;
  MOEKIT_RETURN_IF_ERROR(read_counts(op, "recv_tokens_per_expert", rtpe, 2, &counts));
  if (rtpe.shape[0] != P) {
    return Status::invalid_argument(op, "recv_tokens_per_expert.shape[0]",
                                    std::to_string(rtpe.shape[0]),
                                    fmt::format("must be the {} blocks (ranks)", P));
  }
  const int64_t El = rtpe.shape[1];
  m->runs.clear();
  m->zero.clear();
  std::vector<int64_t> used(static_cast<size_t>(P), 0);  // rows of each block so far
  int64_t flat = 0;
  for (int64_t j = 0; j < El; ++j) {
    for (int64_t q = 0; q < P; ++q) {
      const int64_t rows = counts[static_cast<size_t>(q * El + j)];
      int64_t& u = used[static_cast<size_t>(q)];
      if (u + rows > C) {
        return Status::invalid_argument(op, fmt::format("the rows from rank {}", q),
                                        std::to_string(u + rows),
                                        fmt::format("more than a block holds (C = {})", C));
      }
      if (rows > 0) m->runs.push_back({flat, q * C + u, rows});
      u += rows;
      flat += rows;
    }
  }
  if (flat > flat_rows) {
    return Status::invalid_argument(op, "sum(recv_tokens_per_expert)", std::to_string(flat),
                                    fmt::format("more than x_local's {} rows", flat_rows));
  }
  if (to_blocked) {
    for (int64_t q = 0; q < P; ++q) {
      const int64_t u = used[static_cast<size_t>(q)];
      if (u < C) m->zero.emplace_back(q * C + u, (q + 1) * C);
    }
  } else if (flat < flat_rows) {
    m->zero.emplace_back(flat, flat_rows);
  }
  return {};
}

// Moves the rows (flat -> blocked, or back) and zeroes the rest of the destination.
void move_rows(const Moves& m, const void* src, void* dst, int64_t row_bytes, bool to_blocked) {
  const auto* from = static_cast<const std::byte*>(src);
  auto* to = static_cast<std::byte*>(dst);
  const int64_t n = static_cast<int64_t>(m.runs.size()), z = static_cast<int64_t>(m.zero.size());
#pragma omp parallel
  {
#pragma omp for schedule(dynamic) nowait
    for (int64_t i = 0; i < n; ++i) {
      const Run& r = m.runs[static_cast<size_t>(i)];
      const int64_t a = to_blocked ? r.flat : r.blocked, b = to_blocked ? r.blocked : r.flat;
      std::memcpy(to + b * row_bytes, from + a * row_bytes,
                  static_cast<size_t>(r.rows * row_bytes));
    }
#pragma omp for schedule(dynamic)
    for (int64_t i = 0; i < z; ++i) {
      const auto [lo, hi] = m.zero[static_cast<size_t>(i)];
      std::memset(to + lo * row_bytes, 0, static_cast<size_t>((hi - lo) * row_bytes));
    }
  }
}

// One of the four: checks, moves. `flat` and `blocked` are the two sides; `to_blocked` says which
// is written.
Status fixed_layout(const char* op, bool regroup, const char* flat_name, const char* blocked_name,
                    const ConstTensorView& flat, const ConstTensorView& blocked,
                    const ConstTensorView& counts, bool to_blocked, void* dst) {
  int64_t row_bytes = 0;
  MOEKIT_RETURN_IF_ERROR(check_flat(op, flat_name, flat, &row_bytes));
  MOEKIT_RETURN_IF_ERROR(check_blocked(op, blocked_name, blocked, flat, flat_name));
  thread_local Moves m;  // kept from call to call: no allocation once grown
  const int64_t P = blocked.shape[0], C = blocked.shape[1];
  MOEKIT_RETURN_IF_ERROR(regroup ? regroup_moves(op, counts, P, C, flat.shape[0], to_blocked, &m)
                                 : pack_moves(op, counts, P, C, flat.shape[0], to_blocked, &m));
  // Source and destination must not overlap (a row could be overwritten before it is read).
  const char* counts_name = regroup ? "recv_tokens_per_expert" : "tokens_per_expert";
  MOEKIT_RETURN_IF_ERROR(
      to_blocked ? detail::check_disjoint(op, {{blocked_name, blocked}},
                                          {{flat_name, flat}, {counts_name, counts}})
                 : detail::check_disjoint(op, {{flat_name, flat}},
                                          {{blocked_name, blocked}, {counts_name, counts}}));
  move_rows(m, to_blocked ? flat.data : blocked.data, dst, row_bytes, to_blocked);
  return {};
}

}  // namespace

Status ep_pack(ConstTensorView x_perm, ConstTensorView tokens_per_expert, TensorView send) {
  return fixed_layout("ep_pack", false, "x_perm", "send", x_perm, send, tokens_per_expert, true,
                      send.data);
}

Status ep_unpack(ConstTensorView send, ConstTensorView tokens_per_expert, TensorView x_perm) {
  return fixed_layout("ep_unpack", false, "x_perm", "send", x_perm, send, tokens_per_expert, false,
                      x_perm.data);
}

Status ep_regroup(ConstTensorView recv, ConstTensorView recv_tokens_per_expert,
                  TensorView x_local) {
  return fixed_layout("ep_regroup", true, "x_local", "recv", x_local, recv, recv_tokens_per_expert,
                      false, x_local.data);
}

Status ep_ungroup(ConstTensorView x_local, ConstTensorView recv_tokens_per_expert,
                  TensorView recv) {
  return fixed_layout("ep_ungroup", true, "x_local", "recv", x_local, recv, recv_tokens_per_expert,
                      true, recv.data);
}

}  // namespace moekit
