// moekit bench layer --ep P: the MoE layer over P ranks (moe_layer_ep_forward / _backward), each
// rank with --tokens tokens and E / P of a preset's experts, step by step, dispatch and combine
// among the steps. Beside it, run by run: the one-rank layer on all P * T tokens, on rank 0, with
// as many OpenMP threads as the group's ranks on this machine have together, while the other
// ranks sleep. The same global work on the same cores: the ratio of the two throughputs is what
// splitting the layer over ranks costs.
#include <fmt/format.h>
#include <omp.h>
#include <sched.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>
#include <numeric>
#include <stdexcept>
#include <thread>

#include "bench_common.h"
#include "bench_layer.h"
#include "ep_group.h"
#include "moekit/layer.h"
#include "presets.h"

namespace moekit::tools {
namespace {

using Clock = std::chrono::steady_clock;

// While it lives, the calling thread may run on every CPU of the machine; then the binding it had
// comes back. mpiexec binds each rank to its own cores, and the one-rank layer must have them
// all (its OpenMP threads are started from this thread, and inherit the binding they see).
class OnEveryCpu {
 public:
  OnEveryCpu() {
    ok_ = sched_getaffinity(0, sizeof saved_, &saved_) == 0;
    cpu_set_t all;
    CPU_ZERO(&all);
    for (int c = 0; c < CPU_SETSIZE && c < static_cast<int>(std::thread::hardware_concurrency());
         ++c) {
      CPU_SET(c, &all);
    }
    ok_ = ok_ && sched_setaffinity(0, sizeof all, &all) == 0;
  }
  ~OnEveryCpu() {
    if (ok_) sched_setaffinity(0, sizeof saved_, &saved_);
  }
  OnEveryCpu(const OnEveryCpu&) = delete;
  OnEveryCpu& operator=(const OnEveryCpu&) = delete;
  bool ok() const { return ok_; }

 private:
  cpu_set_t saved_;
  bool ok_ = false;
};

// How many CPUs this thread may run on.
int allowed_cpus() {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
}

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// The seed of rank q's tokens.
uint64_t token_seed(uint64_t seed, int q) { return seed + 7919 * static_cast<uint64_t>(q + 1); }

// The weights and data of one layer: x and d_out [T, H] (the tokens of ranks `ranks[0]` ..,
// T / ranks.size() each), the router, `experts` experts (the first-th on) and their gradients.
// A rank's tokens, and an expert's weights, are the same whoever holds them.
struct LayerData {
  LayerData(const Preset& p, const MoeLayerConfig& cfg, int64_t T, const std::vector<int>& ranks,
            int64_t first, int64_t experts, DType dt, uint64_t seed)
      : H(p.H),
        F(p.F),
        W(2 * p.F),
        Fs(cfg.shared_ffn),
        El(experts),
        es(dtype_size(dt)),
        x(T * H * es),
        d_out(T * H * es),
        out(T * H * es),
        d_x(T * H * es),
        router(H * p.E * es),
        g_router(H * p.E * es),
        w_in(El * H * W * es),
        g_in(El * H * W * es),
        w_out(El * F * H * es),
        g_out(El * F * H * es),
        shared_in(H * 2 * Fs * es),
        g_shared_in(H * 2 * Fs * es),
        shared_out(Fs * H * es),
        g_shared_out(Fs * H * es) {
    const int64_t block = T / static_cast<int64_t>(ranks.size());
    for (size_t b = 0; b < ranks.size(); ++b) {
      const int64_t at = static_cast<int64_t>(b) * block * H * static_cast<int64_t>(es);
      fill_uniform(static_cast<std::byte*>(x.data()) + at, dt, block * H,
                   token_seed(seed, ranks[b]) + 1);
      fill_uniform(static_cast<std::byte*>(d_out.data()) + at, dt, block * H,
                   token_seed(seed, ranks[b]) + 2);
    }
    fill_uniform(router.data(), dt, H * p.E, seed + 3);
    for (int64_t e = 0; e < El; ++e) {
      const uint64_t s = seed + 1000 * static_cast<uint64_t>(first + e);
      fill_uniform(static_cast<std::byte*>(w_in.data()) + e * H * W * es, dt, H * W, s + 4);
      fill_uniform(static_cast<std::byte*>(w_out.data()) + e * F * H * es, dt, F * H, s + 5);
    }
    fill_uniform(shared_in.data(), dt, H * 2 * Fs, seed + 6);
    fill_uniform(shared_out.data(), dt, Fs * H, seed + 7);
    w = MoeLayerWeights();
    w.router = ConstTensorView(router.data(), dt, {H, p.E});
    const auto [in_rows, in_cols] = expert_matrix(cfg, H, W);
    const auto [out_rows, out_cols] = expert_matrix(cfg, F, H);
    w.w_in = ConstTensorView(w_in.data(), dt, {El, in_rows, in_cols});
    w.w_out = ConstTensorView(w_out.data(), dt, {El, out_rows, out_cols});
    g = MoeLayerWeightGrads();
    g.router = TensorView(g_router.data(), dt, {H, p.E});
    g.w_in = TensorView(g_in.data(), dt, {El, in_rows, in_cols});
    g.w_out = TensorView(g_out.data(), dt, {El, out_rows, out_cols});
    if (Fs > 0) {
      w.shared_in = ConstTensorView(shared_in.data(), dt, {H, 2 * Fs});
      w.shared_out = ConstTensorView(shared_out.data(), dt, {Fs, H});
      g.shared_in = TensorView(g_shared_in.data(), dt, {H, 2 * Fs});
      g.shared_out = TensorView(g_shared_out.data(), dt, {Fs, H});
    }
    xv = ConstTensorView(x.data(), dt, {T, H});
    d_out_v = ConstTensorView(d_out.data(), dt, {T, H});
    out_v = TensorView(out.data(), dt, {T, H});
    d_x_v = TensorView(d_x.data(), dt, {T, H});
  }
  static double bytes(const Preset& p, const MoeLayerConfig& cfg, int64_t T, int64_t experts,
                      DType dt) {
    const double H = p.H, F = p.F, Fs = cfg.shared_ffn;
    return 2.0 * dtype_size(dt) *
           (4 * T * H + H * p.E + experts * 3 * H * F + 3 * H * Fs);  // weights and gradients
  }

  int64_t H, F, W, Fs, El;
  size_t es;
  Buffer x, d_out, out, d_x, router, g_router, w_in, g_in, w_out, g_out, shared_in, g_shared_in,
      shared_out, g_shared_out;
  MoeLayerWeights w;
  MoeLayerWeightGrads g;
  ConstTensorView xv, d_out_v;
  TensorView out_v, d_x_v;
};

// The steps' medians over the timed runs.
std::array<double, kMoeSteps> step_medians(const std::vector<MoeLayerProfile>& runs) {
  std::array<double, kMoeSteps> out{};
  for (int s = 0; s < kMoeSteps; ++s) {
    std::vector<double> v;
    for (const MoeLayerProfile& r : runs) v.push_back(r.ms[s]);
    out[s] = summarize(v).median_ms;
  }
  return out;
}

struct EpResult {
  std::string preset;
  int64_t tokens = 0;  // per rank
  Timing fwd, bwd, ref_fwd, ref_bwd;
  std::array<double, kMoeSteps> fwd_steps{}, bwd_steps{}, ref_fwd_steps{}, ref_bwd_steps{};
  double rows_max = 0, rows_mean = 0;
  // Throughput of the P ranks over that of the one rank, forward + backward.
  double ratio() const {
    return (ref_fwd.median_ms + ref_bwd.median_ms) / (fwd.median_ms + bwd.median_ms);
  }
};

// One preset at T tokens per rank; false (with the reason, on every rank) when it does not fit.
bool run_one(EpRank& r, const Preset& p, int64_t T, const LayerOptions& o, DType dt, EpResult& res,
             std::string& skipped) {
  Communicator& comm = r.comm;
  const int P = comm.size(), me = comm.rank();
  std::vector<float> bias;
  const MoeLayerConfig cfg = preset_config(p, o, bias);
  if (p.E % P != 0) {
    skipped = fmt::format("{}: E = {} experts, not divisible by {} ranks", p.name, p.E, P);
    return false;
  }
  const int64_t El = p.E / P, all = T * P;
  const MoeLayerWorkspace ws = moe_layer_workspace(cfg, all, dt);
  // Rank 0 holds its shard and the whole one-rank layer; the state of a rank is about its share
  // of the one-rank layer's buffers (more on the rank that receives the most rows).
  const double need = LayerData::bytes(p, cfg, T, El, dt) + LayerData::bytes(p, cfg, all, p.E, dt) +
                      1.5 * (ws.saved_bytes + ws.forward_bytes + ws.backward_bytes) / P +
                      ws.saved_bytes + std::max(ws.forward_bytes, ws.backward_bytes);
  if (need > o.mem_limit_gib * kGiB) {
    skipped = fmt::format(
        "{}: needs about {:.1f} GiB on rank 0 at {} tokens per rank, over "
        "--mem-limit-gib {}",
        p.name, need / kGiB, T, o.mem_limit_gib);
    return false;
  }
  LayerData mine(p, cfg, T, {me}, me * El, El, dt, o.seed);
  MoeLayerEpState state;
  float aux = 0;
  const MoeLayerOutputs outs{mine.out_v, &aux, nullptr, {}};
  std::vector<MoeLayerProfile> fwd_prof, bwd_prof, ref_fwd_prof, ref_bwd_prof;
  std::vector<double> fwd_ms, bwd_ms, ref_fwd_ms, ref_bwd_ms;

  // The one-rank layer on every rank's tokens, on rank 0 only.
  std::unique_ptr<LayerData> ref;
  Buffer saved, fwd_scratch, bwd_scratch;
  if (r.root()) {
    std::vector<int> every(static_cast<size_t>(P));
    std::iota(every.begin(), every.end(), 0);
    ref = std::make_unique<LayerData>(p, cfg, all, every, 0, p.E, dt, o.seed);
    saved = Buffer(ws.saved_bytes), fwd_scratch = Buffer(ws.forward_bytes);
    bwd_scratch = Buffer(ws.backward_bytes);
  }
  const int rank_threads = omp_get_max_threads();
  const int ref_threads = rank_threads * r.local_ranks;
  const int total = o.warmup + o.reps;
  for (int run = 0; run < total; ++run) {
    MoeLayerProfile pf, pb;
    barrier(comm);
    auto t0 = Clock::now();
    check(moe_layer_ep_forward(mine.xv, mine.w, cfg, comm, &state, outs, &pf));
    barrier(comm);
    const double f = ms_since(t0);
    t0 = Clock::now();
    check(moe_layer_ep_backward(mine.xv, mine.w, cfg, comm, &state, mine.d_out_v, 1.0f, 0.0f,
                                mine.d_x_v, mine.g, &pb));
    barrier(comm);
    const double b = ms_since(t0);
    quiet_barrier(r);  // the other ranks sleep while rank 0 times the one-rank layer
    if (r.root()) {
      OnEveryCpu unbound;
      if (!unbound.ok()) throw std::runtime_error("rank 0 could not unbind itself from its cores");
      omp_set_num_threads(ref_threads);
      MoeLayerProfile rf, rb;
      float ref_aux = 0;
      t0 = Clock::now();
      check(moe_layer_forward(ref->xv, ref->w, cfg,
                              {static_cast<std::byte*>(saved.data()), saved.bytes()},
                              {static_cast<std::byte*>(fwd_scratch.data()), fwd_scratch.bytes()},
                              {ref->out_v, &ref_aux, nullptr, {}}, &rf));
      const double rfm = ms_since(t0);
      t0 = Clock::now();
      check(moe_layer_backward(ref->xv, ref->w, cfg,
                               {static_cast<const std::byte*>(saved.data()), saved.bytes()},
                               ref->d_out_v, 1.0f, 0.0f,
                               {static_cast<std::byte*>(bwd_scratch.data()), bwd_scratch.bytes()},
                               ref->d_x_v, ref->g, &rb));
      const double rbm = ms_since(t0);
      omp_set_num_threads(rank_threads);
      if (run >= o.warmup) {
        ref_fwd_prof.push_back(rf), ref_bwd_prof.push_back(rb);
        ref_fwd_ms.push_back(rfm), ref_bwd_ms.push_back(rbm);
      }
    }
    quiet_barrier(r);
    if (run >= o.warmup) {
      fwd_prof.push_back(pf), bwd_prof.push_back(pb);
      fwd_ms.push_back(f), bwd_ms.push_back(b);
    }
  }
  std::vector<int64_t> recv(static_cast<size_t>(P));
  check(comm.all_gather(&state.plan().recv_rows, recv.data(), sizeof(int64_t)));
  res.preset = p.name;
  res.tokens = T;
  res.fwd = summarize(fwd_ms), res.bwd = summarize(bwd_ms);
  res.fwd_steps = step_medians(fwd_prof), res.bwd_steps = step_medians(bwd_prof);
  res.rows_max = static_cast<double>(*std::max_element(recv.begin(), recv.end()));
  res.rows_mean = std::accumulate(recv.begin(), recv.end(), 0.0) / P;
  if (r.root()) {
    res.ref_fwd = summarize(ref_fwd_ms), res.ref_bwd = summarize(ref_bwd_ms);
    res.ref_fwd_steps = step_medians(ref_fwd_prof), res.ref_bwd_steps = step_medians(ref_bwd_prof);
  }
  return true;
}

void print_result(std::FILE* f, const EpResult& r, const Preset& p, DType dt, int P,
                  int rank_threads, int ref_threads) {
  fmt::print(f, "\n{}  {} ranks x {} tokens = {}  {}  H={} F={} E={} (E_loc={}) k={}{}\n", r.preset,
             P, r.tokens, P * r.tokens, dtype_name(dt), p.H, p.F, p.E, p.E / P, p.k,
             p.shared_experts ? fmt::format(", {} shared", p.shared_experts) : "");
  fmt::print(f, "{:<12} {:>24}   {:>24}\n", "",
             fmt::format("{} ranks x {} thread(s)", P, rank_threads),
             fmt::format("1 rank x {} threads", ref_threads));
  fmt::print(f, "{:<12} {:>11} {:>12}   {:>11} {:>12}\n", "step", "fwd ms", "bwd ms", "fwd ms",
             "bwd ms");
  for (int s = 0; s < kMoeSteps; ++s) {
    if (r.fwd_steps[s] == 0 && r.bwd_steps[s] == 0 && r.ref_fwd_steps[s] == 0) continue;
    fmt::print(f, "{:<12} {:>11.2f} {:>12.2f}   {:>11.2f} {:>12.2f}\n",
               moe_step_name(static_cast<MoeStep>(s)), r.fwd_steps[s], r.bwd_steps[s],
               r.ref_fwd_steps[s], r.ref_bwd_steps[s]);
  }
  fmt::print(f, "{:<12} {:>11.2f} {:>12.2f}   {:>11.2f} {:>12.2f}\n", "layer", r.fwd.median_ms,
             r.bwd.median_ms, r.ref_fwd.median_ms, r.ref_bwd.median_ms);
  const double global = static_cast<double>(P * r.tokens);
  fmt::print(f,
             "tokens/s forward+backward: {:.0f} on {} ranks, {:.0f} on one: the ranks at "
             "{:.1f}% of the one rank's throughput\n",
             1e3 * global / (r.fwd.median_ms + r.bwd.median_ms), P,
             1e3 * global / (r.ref_fwd.median_ms + r.ref_bwd.median_ms), 100 * r.ratio());
  fmt::print(f, "rows received per rank: max {:.0f}, mean {:.0f} (max / mean {:.3f})\n", r.rows_max,
             r.rows_mean, r.rows_max / r.rows_mean);
}

nlohmann::json result_json(const EpResult& r, DType dt, const LayerOptions& o, EpRank& rank,
                           bool backward, int rank_threads, int ref_threads) {
  auto steps = [&](const std::array<double, kMoeSteps>& a) {
    nlohmann::json j = nlohmann::json::object();
    for (int s = 0; s < kMoeSteps; ++s) {
      if (a[s] > 0) j[moe_step_name(static_cast<MoeStep>(s))] = a[s];
    }
    return j;
  };
  const int P = rank.comm.size();
  const Timing& t = backward ? r.bwd : r.fwd;
  const Timing& ref = backward ? r.ref_bwd : r.ref_fwd;
  return {{"op", "layer"},
          {"pass", backward ? "bwd" : "fwd"},
          {"preset", r.preset},
          {"ranks", P},
          {"engine", rank.comm.engine()},
          {"tokens", r.tokens},
          {"device", "cpu"},
          {"global_tokens", P * r.tokens},
          {"dtype", std::string(dtype_name(dt))},
          {"capacity_factor", o.capacity_factor},
          {"threads_per_rank", rank_threads},
          {"oversubscribed", !rank.warning.empty()},
          {"ms", t.median_ms},
          {"min_ms", t.min_ms},
          {"steps_ms", steps(backward ? r.bwd_steps : r.fwd_steps)},
          {"tokens_per_s", 1e3 * P * r.tokens / t.median_ms},
          {"one_rank_threads", ref_threads},
          {"one_rank_ms", ref.median_ms},
          {"one_rank_steps_ms", steps(backward ? r.ref_bwd_steps : r.ref_fwd_steps)},
          {"ratio_to_one_rank", ref.median_ms / t.median_ms},
          {"fwd_bwd_ratio_to_one_rank", r.ratio()},
          {"rows_received_max", r.rows_max},
          {"rows_received_mean", r.rows_mean}};
}

}  // namespace

void run_layer_ep(const LayerOptions& o) {
  const std::vector<const Preset*> todo = presets_of(o.preset);
  const DType dt = parse_dtype(o.dtype);
  EpGroupOptions group = o.group;
  if (group.ranks != 0 && group.ranks != o.ep) {
    throw CLI::ValidationError("--ranks",
                               fmt::format("{} with --ep {}: give one", group.ranks, o.ep));
  }
  group.ranks = o.ep;
  run_ep_group(group, [&](EpRank& r) {
    const int P = r.comm.size();
    std::FILE* text = o.json ? stderr : stdout;  // --json keeps stdout for the JSON array
    const int rank_threads = omp_get_max_threads(), ref_threads = rank_threads * r.local_ranks;
    if (r.root()) {
      fmt::print(text,
                 "moekit bench layer --ep {}  engine={} ({} ranks on this machine, {} OpenMP "
                 "thread(s) each, rank 0 on {} CPU(s); the one-rank layer beside it: {} threads "
                 "on every CPU)  dtype={}  {}  SwiGLU, aux loss coeff {}, median of {} runs after "
                 "{} warm-up  {}  {}\n",
                 P, r.comm.engine(), r.local_ranks, rank_threads, allowed_cpus(), ref_threads,
                 dtype_name(dt),
                 o.capacity_factor > 0 ? fmt::format("capacity factor {}", o.capacity_factor)
                                       : std::string("dropless"),
                 o.aux_loss_coeff, o.reps, o.warmup, machine_description(), today_iso());
      if (!r.warning.empty()) fmt::print(text, "{}\n", r.warning);
    }
    Progress progress(static_cast<int>(todo.size() * o.tokens.size()));  // rank 0's
    std::vector<EpResult> results;
    std::vector<std::string> skipped;
    for (const Preset* p : todo) {
      for (int64_t T : o.tokens) {
        if (r.root()) {
          progress.step(fmt::format("{} {} x {} tokens: the layer on {} ranks, and on one", p->name,
                                    P, T, P));
        }
        EpResult res;
        std::string why;
        if (run_one(r, *p, T, o, dt, res, why)) {
          results.push_back(res);
        } else {
          skipped.push_back(why);
        }
      }
    }
    if (!r.root()) return;
    progress.finish();
    for (const EpResult& res : results) {
      print_result(text, res, *find_preset(res.preset), dt, P, rank_threads, ref_threads);
    }
    for (const std::string& s : skipped) fmt::print(text, "\nskipped {}\n", s);
    if (!results.empty()) {
      std::vector<std::string> labels;
      std::vector<double> ratio;
      for (const EpResult& res : results) {
        labels.push_back(fmt::format("{} {}x{}", res.preset, P, res.tokens));
        ratio.push_back(100 * res.ratio());
      }
      fmt::print(text,
                 "\n{} ranks' throughput (forward + backward) against one rank's on the same "
                 "tokens and cores\n{}",
                 P, ascii_bars(labels, ratio, "%"));
    }
    if (o.json) {
      nlohmann::json arr = nlohmann::json::array();
      for (const EpResult& res : results) {
        arr.push_back(result_json(res, dt, o, r, false, rank_threads, ref_threads));
        arr.push_back(result_json(res, dt, o, r, true, rank_threads, ref_threads));
      }
      fmt::print("{}\n", arr.dump(1));
    }
  });
}

}  // namespace moekit::tools
