// moekit bench dispatch: the expert-parallel exchange (SPEC.md section 4) on P ranks, each with
// `--tokens` tokens of a preset routed by the preset's router on random logits (a seed per rank)
// and permuted: the plan's latency, and dispatch and combine beside the plain all-to-all of the
// same counts, timed run by run in the same process.
//
// The reference: under MPI, MPI_Alltoallv of the same rows (one contiguous block per peer, into
// the [source rank][local expert] order) and back; with the threads engine, the engine's own
// exchange of one block per peer. "alltoallv+regroup" adds the regroup to [local expert][source
// rank] with sort_chunks_by_index: the way SPEC.md describes, which moekit's dispatch replaces by
// sending each (rank, expert) block straight to its place.
//
// GB/s: the rows that cross the group (every rank's send_rows, summed) times two (sent and
// received) over the ranks: the bytes a rank moves, on average, per second.
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <numeric>

#include "bench_common.h"
#include "benches.h"
#include "ep_group.h"
#include "moekit/ep.h"
#include "moekit/permute.h"
#include "moekit/router.h"
#include "presets.h"

#if MOEKIT_TOOL_MPI
#include <mpi.h>
#endif

namespace moekit::tools {
namespace {

struct DispatchOptions : BenchOptions {
  EpGroupOptions group;
};

// One timed row of the table.
struct Row {
  int64_t tokens;
  std::string op;
  Timing t;
  double gbps = 0;   // 0: not a rate (the plan)
  double ratio = 0;  // over the reference of its direction; 0: none
};

// This rank's routed, permuted tokens: x_perm [N, H] and tokens_per_expert [E].
struct Permuted {
  Buffer x_perm, tokens_per_expert;
  int64_t rows = 0;
};

Permuted route_and_permute(const Preset& p, int64_t T, DType dt, uint64_t seed) {
  const int64_t E = p.E, H = p.H, N = T * p.k;
  const int32_t k = static_cast<int32_t>(p.k);
  std::vector<float> bias;
  const RouteOptions ro = preset_route_options(p, seed, bias);
  Buffer logits(T * E * 4), idx(N * 4), w(N * 4), x(T * H * dtype_size(dt)), row_map(2 * N * 4);
  fill_uniform(logits.data(), DType::kF32, T * E, seed + 1);
  fill_uniform(x.data(), dt, T * H, seed + 2);
  const TensorView idx_v(idx.data(), DType::kI32, {T, k});
  check(route(ConstTensorView(logits.data(), DType::kF32, {T, E}), ro,
              {{}, {}, idx_v, TensorView(w.data(), DType::kF32, {T, k})}));
  Permuted out{Buffer(N * H * dtype_size(dt)), Buffer(E * 4), N};
  check(permute(ConstTensorView(x.data(), dt, {T, H}), idx_v, {}, {},
                {TensorView(out.x_perm.data(), dt, {N, H}),
                 {},
                 TensorView(out.tokens_per_expert.data(), DType::kI32, {E}),
                 TensorView(row_map.data(), DType::kI32, {2, T, k}),
                 {}}));
  return out;
}

// The reference exchange of `plan`'s counts, one contiguous block per peer: forward from the
// [send_rows, H] buffer `a` into the [recv_rows, H] buffer `b` ([source rank][local expert]), or
// back.
class PlainAllToAll {
 public:
  PlainAllToAll(EpRank& r, const EpPlan& plan, size_t row_bytes)
      : r_(r), plan_(plan), row_bytes_(row_bytes) {
#if MOEKIT_TOOL_MPI
    if (r.mpi_comm) {
      MPI_Type_contiguous(static_cast<int>(row_bytes), MPI_BYTE, &row_);
      MPI_Type_commit(&row_);
      for (const auto* v :
           {&plan.send_counts, &plan.send_offsets, &plan.recv_counts, &plan.recv_offsets}) {
        ints_.emplace_back(v->begin(), v->end());  // MPI takes int counts (rows here)
      }
    }
#endif
  }
  ~PlainAllToAll() {
#if MOEKIT_TOOL_MPI
    if (r_.mpi_comm) MPI_Type_free(&row_);
#endif
  }
  PlainAllToAll(const PlainAllToAll&) = delete;
  PlainAllToAll& operator=(const PlainAllToAll&) = delete;

  void run(void* a, void* b, bool forward) {
#if MOEKIT_TOOL_MPI
    if (r_.mpi_comm) {
      const MPI_Comm comm = *static_cast<MPI_Comm*>(r_.mpi_comm);
      const int *sc = ints_[0].data(), *sd = ints_[1].data(), *rc = ints_[2].data(),
                *rd = ints_[3].data();
      const int code = forward ? MPI_Alltoallv(a, sc, sd, row_, b, rc, rd, row_, comm)
                               : MPI_Alltoallv(b, rc, rd, row_, a, sc, sd, row_, comm);
      if (code != MPI_SUCCESS) throw std::runtime_error("MPI_Alltoallv failed");
      return;
    }
#endif
    send_.clear();
    recv_.clear();
    auto* pa = static_cast<std::byte*>(a);
    auto* pb = static_cast<std::byte*>(b);
    for (int q = 0; q < plan_.num_ranks; ++q) {
      std::byte* sa = pa + plan_.send_offsets[q] * row_bytes_;
      std::byte* rb = pb + plan_.recv_offsets[q] * row_bytes_;
      if (forward) {
        send_.push_back({q, sa, plan_.send_counts[q]});
        recv_.push_back({q, rb, plan_.recv_counts[q]});
      } else {
        send_.push_back({q, rb, plan_.recv_counts[q]});
        recv_.push_back({q, sa, plan_.send_counts[q]});
      }
    }
    int64_t ticket = 0;
    check(r_.comm.exchange_start(row_bytes_, send_, recv_, &ticket));
    check(r_.comm.exchange_wait(ticket));
  }

 private:
  EpRank& r_;
  const EpPlan& plan_;
  size_t row_bytes_;
  std::vector<SendBlock> send_;
  std::vector<RecvBlock> recv_;
#if MOEKIT_TOOL_MPI
  MPI_Datatype row_ = MPI_DATATYPE_NULL;
  std::vector<std::vector<int>> ints_;
#endif
};

void run(const DispatchOptions& o) {
  const Preset* p = find_preset(o.preset);
  if (!p) {
    throw CLI::ValidationError("--preset",
                               "unknown preset '" + o.preset + "'; known: " + preset_names());
  }
  const DType dt = parse_dtype(o.dtype);
  run_ep_group(o.group, [&](EpRank& r) {
    Communicator& comm = r.comm;
    const int P = comm.size(), me = comm.rank();
    if (p->E % P != 0) {
      throw std::runtime_error(
          fmt::format("{} has E = {} experts, not divisible by {} ranks", p->name, p->E, P));
    }
    std::FILE* text = o.json ? stderr : stdout;  // --json keeps stdout for the JSON array
    if (r.root()) {
      fmt::print(text,
                 "moekit bench dispatch  engine={} ranks={} ({} on this machine)  preset={} "
                 "(H={} E={} k={})  {}  median of {} runs after {} warm-up  {}  {}\n",
                 comm.engine(), P, r.local_ranks, p->name, p->H, p->E, p->k, dtype_name(dt), o.reps,
                 o.warmup, machine_description(), today_iso());
      if (!r.warning.empty()) fmt::print(text, "{}\n", r.warning);
    }
    const size_t row_bytes = static_cast<size_t>(p->H) * dtype_size(dt);
    const int64_t El = p->E / P;
    Progress progress(static_cast<int>(o.tokens.size()));  // rank 0's
    std::vector<Row> rows;
    std::vector<nlohmann::json> stats;
    for (int64_t T : o.tokens) {
      if (r.root()) progress.step(fmt::format("{} T={} per rank", p->name, T));
      Permuted in = route_and_permute(*p, T, dt, o.seed + 7919 * static_cast<uint64_t>(me));
      const ConstTensorView tpe(in.tokens_per_expert.data(), DType::kI32, {p->E});
      EpPlan plan;
      check(ep_plan(tpe, comm, &plan));
      const int64_t R = plan.recv_rows, N = plan.send_rows;
      Buffer x_local(std::max<int64_t>(R, 1) * row_bytes), y_perm(N * row_bytes);
      Buffer staging(std::max<int64_t>(R, 1) * row_bytes),
          regrouped(std::max<int64_t>(R, 1) * row_bytes);
      const ConstTensorView x_perm_v(in.x_perm.data(), dt, {N, p->H});
      const TensorView x_local_v(x_local.data(), dt, {R, p->H}),
          y_perm_v(y_perm.data(), dt, {N, p->H});
      // The regroup of the plain all-to-all's [source][local expert] chunks.
      std::vector<int32_t> split(plan.recv_tokens_per_expert), order(static_cast<size_t>(P * El));
      for (int64_t j = 0; j < El; ++j) {
        for (int q = 0; q < P; ++q) order[j * P + q] = static_cast<int32_t>(q * El + j);
      }
      PlainAllToAll plain(r, plan, row_bytes);
      EpPlan replan;
      const std::vector<Timing> t = time_collective(
          comm, o.warmup, o.reps,
          {[&] { check(ep_plan(tpe, comm, &replan)); },
           [&] { plain.run(in.x_perm.data(), staging.data(), true); },
           [&] { check(ep_dispatch(plan, x_perm_v, x_local_v, comm)); },
           [&] { plain.run(y_perm.data(), staging.data(), false); },
           [&] { check(ep_combine(plan, x_local_v, y_perm_v, comm)); },
           [&] {
             plain.run(in.x_perm.data(), staging.data(), true);
             check(sort_chunks_by_index(ConstTensorView(staging.data(), dt, {R, p->H}),
                                        ConstTensorView(split.data(), DType::kI32, {P * El}),
                                        ConstTensorView(order.data(), DType::kI32, {P * El}), false,
                                        TensorView(regrouped.data(), dt, {R, p->H})));
           }});
      // The group's load: rows that cross it, and rows received per rank.
      std::vector<int64_t> recv(static_cast<size_t>(P));
      check(comm.all_gather(&R, recv.data(), sizeof(int64_t)));
      const double total = std::accumulate(recv.begin(), recv.end(), 0.0);
      const double moved = 2.0 * total * static_cast<double>(row_bytes) / P;
      const auto gbps = [&](const Timing& x) { return moved / (x.median_ms * 1e-3) / 1e9; };
      const double max_recv = static_cast<double>(*std::max_element(recv.begin(), recv.end()));
      rows.push_back({T, "plan", t[0]});
      rows.push_back({T, "alltoallv", t[1], gbps(t[1])});
      rows.push_back({T, "dispatch", t[2], gbps(t[2]), t[1].median_ms / t[2].median_ms});
      rows.push_back({T, "alltoallv_back", t[3], gbps(t[3])});
      rows.push_back({T, "combine", t[4], gbps(t[4]), t[3].median_ms / t[4].median_ms});
      rows.push_back({T, "alltoallv+regroup", t[5], gbps(t[5]), t[1].median_ms / t[5].median_ms});
      stats.push_back(
          {{"tokens", T}, {"rows_received_max", max_recv}, {"rows_received_mean", total / P}});
    }
    if (!r.root()) return;
    progress.finish();

    fmt::print(text, "\n{:>11}  {:<18}{:>10}{:>10}{:>10}  {}\n", "tokens/rank", "op", "ms",
               "min ms", "GB/s", "vs alltoallv");
    for (const Row& x : rows) {
      fmt::print(text, "{:>11}  {:<18}{:>10.3f}{:>10.3f}{:>10}  {}\n", x.tokens, x.op,
                 x.t.median_ms, x.t.min_ms, x.gbps > 0 ? fmt::format("{:.2f}", x.gbps) : "",
                 x.ratio > 0 ? fmt::format("{:.1f}%", 100 * x.ratio) : "");
    }
    for (const nlohmann::json& s : stats) {
      fmt::print(text, "T={}: rows received per rank: max {}, mean {:.0f} (max / mean {:.3f})\n",
                 s["tokens"].get<int64_t>(), s["rows_received_max"].get<double>(),
                 s["rows_received_mean"].get<double>(),
                 s["rows_received_max"].get<double>() / s["rows_received_mean"].get<double>());
    }
    std::vector<std::string> labels;
    std::vector<double> values;
    for (const Row& x : rows) {
      if (x.op == "dispatch" || x.op == "combine") {
        labels.push_back(fmt::format("T={} {}", x.tokens, x.op));
        values.push_back(100 * x.ratio);
      }
    }
    fmt::print(text,
               "\nvs alltoallv (the plain all-to-all of the same counts, timed beside it):\n{}",
               ascii_bars(labels, values, "%"));
    fmt::print(text,
               "GB/s: the rows crossing the group, times two (sent and received), over the "
               "ranks. alltoallv{}: the same counts in one contiguous block per peer, landing in "
               "[source rank][local expert] order; +regroup adds sort_chunks_by_index into "
               "[local expert][source rank], the order dispatch gives.\n",
               r.mpi_comm ? " (MPI_Alltoallv)" : " (the threads engine's exchange)");
    if (o.json) {
      nlohmann::json arr = nlohmann::json::array();
      for (const Row& x : rows) {
        nlohmann::json j = {{"op", x.op},
                            {"engine", comm.engine()},
                            {"ranks", P},
                            {"tokens", x.tokens},
                            {"preset", p->name},
                            {"H", p->H},
                            {"E", p->E},
                            {"k", p->k},
                            {"dtype", std::string(dtype_name(dt))},
                            {"threads_per_rank", omp_get_max_threads()},
                            {"oversubscribed", !r.warning.empty()},
                            {"ms", x.t.median_ms},
                            {"min_ms", x.t.min_ms}};
        if (x.gbps > 0) j["gbps"] = x.gbps;
        if (x.ratio > 0) j["ratio_to_alltoallv"] = x.ratio;
        for (const nlohmann::json& s : stats) {
          if (s["tokens"] == x.tokens) j.update(s);
        }
        arr.push_back(j);
      }
      fmt::print("{}\n", arr.dump(1));
    }
  });
}

}  // namespace

void register_bench_dispatch(CLI::App& bench) {
  auto opts = std::make_shared<DispatchOptions>();
  opts->preset = "qwen3-30b-a3b";
  opts->tokens = {4096};
  opts->dtype = "bf16";
  opts->warmup = 2;
  opts->reps = 9;
  CLI::App* cmd = bench.add_subcommand(
      "dispatch",
      "Time the expert-parallel plan, dispatch and combine on P ranks beside a plain "
      "all-to-all of the same counts (mpiexec -n P moekit bench dispatch, or --ranks P)");
  add_bench_options(*cmd, *opts, "Row dtype: f32 | bf16");
  add_ep_group_options(*cmd, opts->group);
  cmd->callback([opts] { run(*opts); });
}

}  // namespace moekit::tools
