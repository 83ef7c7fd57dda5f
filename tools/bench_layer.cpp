// moekit bench layer: times the MoE layer's forward and backward on a preset's real shapes, step
// by step, beside dense matmuls of its two grouped matmuls' shapes run in the same process (the
// rate its 6*N*H*F forward and 12*N*H*F backward FLOPs are measured against): oneDNN on the CPU,
// cuBLAS with --device cuda (bench_device.h). On the CPU the forward is also set against its floor
// (roofline.h): the weight bytes it reads (the router, the experts with rows, the shared expert)
// at the read rate, or its FLOPs at the dense rate, both measured in the same loop, the expert
// weights cold by default (--cache).
#include "bench_layer.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <nlohmann/json.hpp>
#include <numeric>

#include "bench_common.h"
#include "bench_device.h"
#include "benches.h"
#include "moekit/layer.h"
#include "moekit/ragged_dot.h"
#include "presets.h"
#include "roofline.h"

namespace moekit::tools {
namespace {

using Options = LayerOptions;

// One preset at one token count.
struct Result {
  std::string preset;
  int64_t tokens = 0, rows = 0;
  // Where the preset's weights do not fit --mem-limit-gib: the experts run (a subset, fewer tokens
  // in proportion) and the token count they stand for; else the preset's E and `tokens`.
  int64_t experts = 0, stands_for = 0;
  Timing fwd, bwd, dense_up, dense_down;
  Timing fwd_inv, bwd_inv;  // with --invariant: the batch-invariant mode's, in the same loop
  Timing fwd_packed;        // with --packed-weights: the forward on them, in the same loop
  std::array<double, kMoeSteps> fwd_steps_packed{};                // its steps' medians, ms
  std::array<double, kMoeSteps> fwd_steps{}, bwd_steps{};          // medians, ms
  std::array<double, kMoeSteps> fwd_steps_inv{}, bwd_steps_inv{};  // the mode's, with --invariant
  std::array<double, kMoeSteps> step_flops{}, step_bytes{};  // forward; backward twice the flops
  // The weight bytes each forward step reads (the router's, the touched experts' of each grouped
  // matmul, the shared expert's): with its FLOPs, the step's own floor.
  std::array<double, kMoeSteps> step_weight_bytes{};
  double gmm_flops_fwd = 0, dense_tflops = 0, dense_ms_fwd = 0;
  std::string dense_impl;
  // The forward's floor (CPU): the weight bytes it reads and its FLOPs, the rates measured in the
  // same loop (a read of the expert weights' own buffers, FloorRead; a dense matmul of 4096 rows
  // by [H, 2F]), and the copies of the expert weights cycled.
  double fwd_weight_bytes = 0, fwd_flops = 0;
  Roofline roof;
  int64_t copies = 1;
  bool has_floor() const { return roof.read_gbps > 0; }
  double fwd_floor_ms() const { return roof.floor_ms(fwd_weight_bytes, fwd_flops); }
  // A forward step's share of its own floor (0 where it reads no weights or has no time).
  double step_share_of_floor(int s) const {
    if (step_weight_bytes[s] <= 0 || fwd_steps[s] <= 0) return 0;
    return roof.floor_ms(step_weight_bytes[s], step_flops[s]) / fwd_steps[s];
  }
  // The grouped matmuls' FLOPs (forward, then twice that backward) at the dense rate, over the
  // layer's forward plus backward.
  double ratio() const { return 3 * dense_ms_fwd / (fwd.median_ms + bwd.median_ms); }
  // The same with the shared expert's matmul FLOPs counted too (at the same rate).
  double ratio_with_shared() const {
    const double shared_ms =
        step_flops[static_cast<int>(MoeStep::kSharedExpert)] / (dense_tflops * 1e9);
    return 3 * (dense_ms_fwd + shared_ms) / (fwd.median_ms + bwd.median_ms);
  }
  // The batch-invariant mode's forward + backward throughput as a share of the default mode's.
  double invariant_rate() const {
    return (fwd.median_ms + bwd.median_ms) / (fwd_inv.median_ms + bwd_inv.median_ms);
  }
};

// The bytes a run of preset p at T tokens holds: the weights and their gradients, the
// activations, the layer's workspaces, the dense references' buffers and (CPU) the floor's read
// probe and dense matmul of kPeakRows rows.
constexpr int64_t kPeakRows = 4096;
double run_bytes(BenchDevice& dev, const Preset& p, int64_t T, const Options& o, DType dt) {
  std::vector<float> bias;
  const MoeLayerConfig cfg = preset_config(p, o, bias);
  const size_t es = dtype_size(dt);
  const int64_t H = p.H, F = p.F, E = p.E, W = 2 * F, Fs = cfg.shared_ffn;
  const int64_t N = moe_layer_rows(cfg, T);
  const MoeLayerWorkspace ws = moe_layer_workspace(cfg, T, dt, dev.device());
  const double weights = static_cast<double>(H * E + E * H * W + E * F * H + H * 2 * Fs + Fs * H);
  const double floor_bytes =
      dev.has_read() ? static_cast<double>(read_probe_bytes() + kPeakRows * (H + W) * es) : 0.0;
  const double packed = o.packed ? static_cast<double>(E * (H * W + F * H)) : 0.0;
  return (2 * weights + packed) * es + 4.0 * T * H * es + ws.saved_bytes + ws.forward_bytes +
         ws.backward_bytes + static_cast<double>(N * (H + W + F + H) * es) + floor_bytes;
}

// Runs preset p at T tokens on dev, whose buffers (`bytes`, run_bytes) fit.
void run_fitted(BenchDevice& dev, const Preset& p, int64_t T, const Options& o, DType dt,
                double bytes, Result& r) {
  std::vector<float> bias;
  MoeLayerConfig cfg = preset_config(p, o, bias);
  const size_t es = dtype_size(dt);
  const int64_t H = p.H, F = p.F, E = p.E, W = 2 * F, Fs = cfg.shared_ffn;
  const MoeLayerWorkspace ws = moe_layer_workspace(cfg, T, dt, dev.device());

  const Mem bias_mem = place_expert_bias(dev, cfg.route);
  Mem x = dev.alloc(T * H * es), out = dev.alloc(T * H * es), d_out = dev.alloc(T * H * es),
      d_x = dev.alloc(T * H * es);
  Mem router = dev.alloc(H * E * es);
  std::vector<Mem> w_in{dev.alloc(E * H * W * es)}, w_out{dev.alloc(E * F * H * es)};
  Mem shared_in = dev.alloc(H * 2 * Fs * es), shared_out = dev.alloc(Fs * H * es);
  Mem g_router = dev.alloc(H * E * es), g_in = dev.alloc(E * H * W * es),
      g_out = dev.alloc(E * F * H * es);
  Mem g_shared_in = dev.alloc(H * 2 * Fs * es), g_shared_out = dev.alloc(Fs * H * es);
  Mem saved = dev.alloc(ws.saved_bytes), fwd_scratch = dev.alloc(ws.forward_bytes),
      bwd_scratch = dev.alloc(ws.backward_bytes);
  dev.fill(x.data(), dt, T * H, o.seed + 1);
  dev.fill(d_out.data(), dt, T * H, o.seed + 2);
  dev.fill(router.data(), dt, H * E, o.seed + 3);
  dev.fill(w_in[0].data(), dt, E * H * W, o.seed + 4);
  dev.fill(w_out[0].data(), dt, E * F * H, o.seed + 5);
  dev.fill(shared_in.data(), dt, H * 2 * Fs, o.seed + 6);
  dev.fill(shared_out.data(), dt, Fs * H, o.seed + 7);

  // The weights of each copy of the experts' (one until the cold mode adds more); a backward
  // runs with the weights of the forward before it.
  std::vector<MoeLayerWeights> wvs(1);
  size_t cur = 0;
  MoeLayerWeights& wv = wvs[0];
  wv.router = ConstTensorView(router.data(), dt, {H, E});
  const auto [in_rows, in_cols] = expert_matrix(cfg, H, W);
  const auto [out_rows, out_cols] = expert_matrix(cfg, F, H);
  wv.w_in = ConstTensorView(w_in[0].data(), dt, {E, in_rows, in_cols});
  wv.w_out = ConstTensorView(w_out[0].data(), dt, {E, out_rows, out_cols});
  MoeLayerWeightGrads gv;
  gv.router = TensorView(g_router.data(), dt, {H, E});
  gv.w_in = TensorView(g_in.data(), dt, {E, in_rows, in_cols});
  gv.w_out = TensorView(g_out.data(), dt, {E, out_rows, out_cols});
  if (Fs > 0) {
    wv.shared_in = ConstTensorView(shared_in.data(), dt, {H, 2 * Fs});
    wv.shared_out = ConstTensorView(shared_out.data(), dt, {Fs, H});
    gv.shared_in = TensorView(g_shared_in.data(), dt, {H, 2 * Fs});
    gv.shared_out = TensorView(g_shared_out.data(), dt, {Fs, H});
  }
  const ConstTensorView xv(x.data(), dt, {T, H});
  Mem tpe = dev.alloc(E * 4), aux = dev.alloc(4);
  const MoeLayerOutputs outs{TensorView(out.data(), dt, {T, H}), static_cast<float*>(aux.data()),
                             nullptr, TensorView(tpe.data(), DType::kI32, {E})};
  const Exec exec = dev.exec();
  std::vector<MoeLayerProfile> fwd_prof, bwd_prof, fwd_prof_inv, bwd_prof_inv;
  MoeLayerConfig cfg_inv = cfg;
  cfg_inv.batch_invariant = true;
  // One pass with config c; with `profiles`, its profile appended there.
  auto forward_with = [&](const MoeLayerConfig& c, std::vector<MoeLayerProfile>* profiles) {
    MoeLayerProfile prof;
    cur = (cur + 1) % wvs.size();
    check(moe_layer_forward(xv, wvs[cur], c, {saved.bytes_data(), saved.bytes()},
                            {fwd_scratch.bytes_data(), fwd_scratch.bytes()}, outs,
                            profiles ? &prof : nullptr, exec));
    if (profiles) profiles->push_back(prof);
  };
  auto backward_with = [&](const MoeLayerConfig& c, std::vector<MoeLayerProfile>* profiles) {
    MoeLayerProfile prof;
    check(moe_layer_backward(xv, wvs[cur], c, {saved.bytes_data(), saved.bytes()},
                             ConstTensorView(d_out.data(), dt, {T, H}), 1.0f, 0.0f,
                             {bwd_scratch.bytes_data(), bwd_scratch.bytes()},
                             TensorView(d_x.data(), dt, {T, H}), gv, profiles ? &prof : nullptr,
                             exec));
    if (profiles) profiles->push_back(prof);
  };
  // The per-step profile in the timed runs where it costs nothing there (bench_device.h).
  const bool profile_timed = dev.profile_in_timed_runs();
  auto forward = [&] { forward_with(cfg, profile_timed ? &fwd_prof : nullptr); };
  auto backward = [&] { backward_with(cfg, profile_timed ? &bwd_prof : nullptr); };
  forward();  // the routed rows, for the dense reference's shapes
  std::vector<int32_t> sizes(static_cast<size_t>(E));
  dev.to_host(sizes.data(), tpe.data(), sizes.size() * sizeof(int32_t));
  const int64_t rows = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  const auto touched = std::count_if(sizes.begin(), sizes.end(), [](int32_t s) { return s > 0; });
  const double expert_bytes = static_cast<double>((H * W + F * H) * es);
  r.fwd_weight_bytes =
      static_cast<double>((H * E + H * 2 * Fs + Fs * H) * es) + touched * expert_bytes;
  r.fwd_flops = 2.0 * T * H * E + 2.0 * rows * H * W + 2.0 * rows * F * H + 2.0 * T * H * 3 * Fs;
  // Cold: copies of the expert weights, cycled forward by forward, where one forward's would stay
  // in the caches (the router's and the shared expert's are read by every forward as they are).
  if (o.cache == "cold" && dev.has_read()) {
    int64_t copies = cold_copies(touched * expert_bytes);
    const double more = (1 + o.packed) * static_cast<double>(E) * expert_bytes;
    if (bytes + (copies - 1) * more > o.mem_limit_gib * kGiB) {
      copies =
          std::max<int64_t>(1, static_cast<int64_t>((o.mem_limit_gib * kGiB - bytes) / more) + 1);
    }
    for (int64_t c = 1; c < copies; ++c) {
      w_in.push_back(dev.alloc(E * H * W * es));
      w_out.push_back(dev.alloc(E * F * H * es));
      dev.fill(w_in.back().data(), dt, E * H * W, o.seed + 4 + 100 * c);
      dev.fill(w_out.back().data(), dt, E * F * H, o.seed + 5 + 100 * c);
      MoeLayerWeights w = wvs[0];
      w.w_in = ConstTensorView(w_in.back().data(), dt, {E, in_rows, in_cols});
      w.w_out = ConstTensorView(w_out.back().data(), dt, {E, out_rows, out_cols});
      wvs.push_back(w);
    }
    r.copies = copies;
  }

  // --packed-weights: each copy packed (pack_ragged_rhs), and the forward on them.
  std::vector<Mem> packed;
  std::vector<MoeLayerWeights> wvs_packed;
  MoeLayerConfig cfg_packed = cfg;
  cfg_packed.expert_weights_packed = true;
  std::vector<MoeLayerProfile> fwd_prof_packed;
  size_t cur_packed = 0;
  if (o.packed) {
    auto pack = [&](const ConstTensorView& w) {
      const PackedRhsShape s = packed_rhs_shape(w.shape[0], w.shape[1], w.shape[2], dt);
      packed.push_back(dev.alloc(s.dims[0] * s.dims[1] * s.dims[2] * es));
      const TensorView to(packed.back().data(), dt, {s.dims[0], s.dims[1], s.dims[2]});
      check(pack_ragged_rhs(w, to));
      return ConstTensorView(to);
    };
    for (const MoeLayerWeights& w : wvs) {
      MoeLayerWeights p = w;
      p.w_in = pack(w.w_in);
      p.w_out = pack(w.w_out);
      wvs_packed.push_back(p);
    }
  }
  auto forward_packed = [&] {
    MoeLayerProfile prof;
    cur_packed = (cur_packed + 1) % wvs_packed.size();
    check(moe_layer_forward(xv, wvs_packed[cur_packed], cfg_packed,
                            {saved.bytes_data(), saved.bytes()},
                            {fwd_scratch.bytes_data(), fwd_scratch.bytes()}, outs, &prof, exec));
    fwd_prof_packed.push_back(prof);
  };

  // Dense references: [rows, H] @ [H, 2F] and [rows, F] @ [F, H] (the weights in the experts'
  // layout), on buffers of their own.
  const int64_t dense_rows = std::max<int64_t>(rows, 1);
  Mem a_up = dev.alloc(dense_rows * H * es), c_up = dev.alloc(dense_rows * W * es);
  Mem a_down = dev.alloc(dense_rows * F * es), c_down = dev.alloc(dense_rows * H * es);
  dev.fill(a_up.data(), dt, rows * H, o.seed + 8);
  dev.fill(a_down.data(), dt, rows * F, o.seed + 9);
  const bool b_t = cfg.expert_weights_transposed;
  const std::unique_ptr<DenseRef> up = dev.dense(dt, dt, rows, H, W, false, b_t),
                                  down = dev.dense(dt, dt, rows, F, H, false, b_t);
  // The floor's rates (CPU): a read of a buffer far larger than the caches, and a dense matmul
  // large enough to be compute-bound.
  Mem probe, a_peak, c_peak;
  std::unique_ptr<DenseRef> peak;
  if (dev.has_read()) {
    probe = dev.alloc(read_probe_bytes());
    dev.fill(probe.data(), DType::kF32, static_cast<int64_t>(probe.bytes() / 4), o.seed + 10);
    a_peak = dev.alloc(kPeakRows * H * es), c_peak = dev.alloc(kPeakRows * W * es);
    dev.fill(a_peak.data(), dt, kPeakRows * H, o.seed + 11);
    peak = dev.dense(dt, dt, kPeakRows, H, W, false, b_t);
  }

  fwd_prof.clear();
  // Each rep in order: a backward reads what the forward before it saved.
  std::vector<std::function<void()>> fns{
      forward, backward, [&] { up->run(a_up.data(), w_in[0].data(), c_up.data()); },
      [&] { down->run(a_down.data(), w_out[0].data(), c_down.data()); }};
  if (o.invariant) {
    fns.push_back([&] { forward_with(cfg_inv, &fwd_prof_inv); });
    fns.push_back([&] { backward_with(cfg_inv, &bwd_prof_inv); });
  }
  const size_t packed_at = fns.size();
  if (o.packed) fns.push_back(forward_packed);
  std::vector<const Mem*> weights;
  for (size_t c = 0; c < w_in.size(); ++c) weights.insert(weights.end(), {&w_in[c], &w_out[c]});
  for (const Mem& m : packed) weights.push_back(&m);
  const FloorRead floor = floor_read(weights, probe);
  const size_t read_at = fns.size();
  if (peak) {
    floor.add_to(dev, fns);
    fns.push_back([&] { peak->run(a_peak.data(), w_in[0].data(), c_peak.data()); });
  }
  const std::vector<Timing> t = dev.time(o.warmup, o.reps, fns);
  if (peak) {
    r.roof.read_gbps = floor.gbps(t, read_at);
    r.roof.dense_tflops = 2.0 * kPeakRows * H * W / (t.back().median_ms * 1e9);
  }
  if (!profile_timed) {  // the steps in runs of their own, as many
    for (int i = 0; i < o.warmup + o.reps; ++i) {
      forward_with(cfg, &fwd_prof);
      backward_with(cfg, &bwd_prof);
    }
  }
  r.preset = p.name, r.tokens = T, r.rows = rows, r.experts = E;
  if (r.stands_for == 0) r.stands_for = T;
  r.fwd = t[0], r.bwd = t[1], r.dense_up = t[2], r.dense_down = t[3];
  if (o.invariant) r.fwd_inv = t[4], r.bwd_inv = t[5];
  if (o.packed) r.fwd_packed = t[packed_at];
  // Each step's median over the timed runs (the warm-up ones dropped).
  auto medians = [&](const std::vector<MoeLayerProfile>& profiles) {
    std::array<double, kMoeSteps> m{};
    for (int s = 0; s < kMoeSteps; ++s) {
      std::vector<double> v;
      for (size_t i = o.warmup; i < profiles.size(); ++i) v.push_back(profiles[i].ms[s]);
      m[s] = summarize(v).median_ms;
    }
    return m;
  };
  r.fwd_steps = medians(fwd_prof), r.bwd_steps = medians(bwd_prof);
  r.fwd_steps_inv = medians(fwd_prof_inv), r.bwd_steps_inv = medians(bwd_prof_inv);
  r.fwd_steps_packed = medians(fwd_prof_packed);
  auto at = [](MoeStep s) { return static_cast<int>(s); };
  const double up_flops = 2.0 * rows * H * W, down_flops = 2.0 * rows * F * H;
  r.step_flops[at(MoeStep::kRouterGemm)] = 2.0 * T * H * E;
  r.step_flops[at(MoeStep::kGmmUp)] = up_flops;
  r.step_flops[at(MoeStep::kGmmDown)] = down_flops;
  r.step_flops[at(MoeStep::kSharedExpert)] = 2.0 * T * H * 3 * Fs;
  r.step_weight_bytes[at(MoeStep::kRouterGemm)] = static_cast<double>(H * E * es);
  r.step_weight_bytes[at(MoeStep::kGmmUp)] = static_cast<double>(touched * H * W * es);
  r.step_weight_bytes[at(MoeStep::kGmmDown)] = static_cast<double>(touched * F * H * es);
  r.step_weight_bytes[at(MoeStep::kSharedExpert)] = static_cast<double>(3 * H * Fs * es);
  r.step_bytes[at(MoeStep::kPermute)] = static_cast<double>((T + rows) * H * es);
  r.step_bytes[at(MoeStep::kUnpermute)] = static_cast<double>((T + rows) * H * es);
  r.step_bytes[at(MoeStep::kActivation)] = static_cast<double>(rows * (W + F) * es);
  r.gmm_flops_fwd = up_flops + down_flops;
  r.dense_tflops = r.gmm_flops_fwd / ((r.dense_up.median_ms + r.dense_down.median_ms) * 1e9);
  r.dense_ms_fwd = r.dense_up.median_ms + r.dense_down.median_ms;
  r.dense_impl = up->impl();
}

// Runs one preset at T tokens on dev; where its buffers would pass --mem-limit-gib, a stated
// subset of its experts (whole groups, as many as fit and the router can choose from) at the
// tokens that give each expert about the same routed rows, T E' / E (at least 1, so that at a few
// tokens each touched expert still has about as many rows as in the whole preset); returns false
// (with the reason) when not even that fits.
bool run_one(BenchDevice& dev, const Preset& p, int64_t T, const Options& o, DType dt, Result& r,
             std::string& skipped, std::string& note) {
  const double limit = o.mem_limit_gib * kGiB;
  const double bytes = run_bytes(dev, p, T, o, dt);
  Preset q = p;
  int64_t t = T;
  double fitted = bytes;
  if (bytes > limit) {
    // Fewer experts, in whole groups, while the router can still choose k of them (with groups:
    // each kept group's k / group_topk best, group_topk groups).
    const int64_t step = std::max<int64_t>(p.num_groups, 1);
    auto routable = [&](int64_t e) {
      if (e < p.k) return false;
      if (p.num_groups == 0) return true;
      const int64_t per_group = e / p.num_groups;
      return per_group >= p.k / p.group_topk && per_group * p.group_topk >= p.k;
    };
    auto tokens_for = [&](int64_t e) { return std::max<int64_t>(1, T * e / p.E); };
    for (q.E = p.E - step; routable(q.E); q.E -= step) {
      fitted = run_bytes(dev, q, tokens_for(q.E), o, dt);
      if (fitted <= limit) break;
    }
    if (!routable(q.E)) {
      skipped = fmt::format(
          "{}: needs {:.1f} GiB at {} tokens, over --mem-limit-gib {}, and so "
          "does every subset of its experts",
          p.name, bytes / kGiB, T, o.mem_limit_gib);
      return false;
    }
    t = tokens_for(q.E);
    note = fmt::format(
        "note: {} at {} tokens needs {:.1f} GiB (> --mem-limit-gib {}); running {} of its {} "
        "experts at {} tokens: {:.2f} routed rows per expert (the whole preset's: {:.2f})",
        p.name, T, bytes / kGiB, o.mem_limit_gib, q.E, p.E, t, static_cast<double>(t * p.k) / q.E,
        static_cast<double>(T * p.k) / p.E);
    r.stands_for = T;
  }
  run_fitted(dev, q, t, o, dt, fitted, r);
  return true;
}

void print_result(std::FILE* f, const Result& r, const Preset& p, DType dt, bool invariant) {
  fmt::print(f, "\n{}  T={}  {}  routed rows N={}  H={} F={} E={} k={}{}{}\n", r.preset, r.tokens,
             dtype_name(dt), r.rows, p.H, p.F, r.experts, p.k,
             p.shared_experts ? fmt::format(", {} shared", p.shared_experts) : "",
             r.experts != p.E
                 ? fmt::format("  ({} of its {} experts, for T={})", r.experts, p.E, r.stands_for)
                 : "");
  fmt::print(f, "{:<12} {:>9} {:>6} {:>12}   {:>9} {:>6} {:>12}{}\n", "step", "fwd ms", "share",
             "fwd rate", "bwd ms", "share", "bwd rate",
             invariant ? fmt::format("   {:>9} {:>9}", "inv fwd", "inv bwd") : "");
  auto rate = [](double ms, double flops, double bytes) -> std::string {
    if (ms <= 0) return "";
    if (flops > 0) return fmt::format("{:.3f} TF/s", flops / (ms * 1e9));
    if (bytes > 0) return fmt::format("{:.1f} GB/s", bytes / (ms * 1e6));
    return "";
  };
  for (int s = 0; s < kMoeSteps; ++s) {
    if (r.fwd_steps[s] == 0 && r.bwd_steps[s] == 0) continue;
    fmt::print(f, "{:<12} {:>9.2f} {:>5.1f}% {:>12}   {:>9.2f} {:>5.1f}% {:>12}{}\n",
               moe_step_name(static_cast<MoeStep>(s)), r.fwd_steps[s],
               100 * r.fwd_steps[s] / r.fwd.median_ms,
               rate(r.fwd_steps[s], r.step_flops[s], r.step_bytes[s]), r.bwd_steps[s],
               100 * r.bwd_steps[s] / r.bwd.median_ms,
               rate(r.bwd_steps[s], 2 * r.step_flops[s], 2 * r.step_bytes[s]),
               invariant
                   ? fmt::format("   {:>9.2f} {:>9.2f}", r.fwd_steps_inv[s], r.bwd_steps_inv[s])
                   : "");
  }
  fmt::print(f, "{:<12} {:>9.2f} {:>6} {:>12}   {:>9.2f} {:>6} {:>12}{}\n", "layer",
             r.fwd.median_ms, "", "", r.bwd.median_ms, "", "",
             invariant
                 ? fmt::format("   {:>9.2f} {:>9.2f}", r.fwd_inv.median_ms, r.bwd_inv.median_ms)
                 : "");
  fmt::print(f, "tokens/s: forward {:.0f}, forward+backward {:.0f}\n",
             1e3 * r.tokens / r.fwd.median_ms,
             1e3 * r.tokens / (r.fwd.median_ms + r.bwd.median_ms));
  fmt::print(f,
             "dense {} on the two grouped matmuls' shapes: {:.3f} TFLOP/s; at that rate "
             "the grouped matmuls take {:.1f} ms fwd + {:.1f} ms bwd; the layer takes {:.1f} ms: "
             "{:.1f}% of dense\n",
             r.dense_impl, r.dense_tflops, r.dense_ms_fwd, 2 * r.dense_ms_fwd,
             r.fwd.median_ms + r.bwd.median_ms, 100 * r.ratio());
  if (p.shared_experts > 0) {
    fmt::print(f,
               "with the shared expert's FLOPs counted too (at the same rate): {:.1f}% of dense\n",
               100 * r.ratio_with_shared());
  }
  if (invariant) {
    fmt::print(f,
               "batch-invariant mode, in the same loop: forward {:.1f} ms, backward {:.1f} ms; "
               "forward+backward throughput {:.1f}% of the default mode's\n",
               r.fwd_inv.median_ms, r.bwd_inv.median_ms, 100 * r.invariant_rate());
  }
  if (r.has_floor()) {
    fmt::print(f,
               "forward floor: {:.1f} MB of weights at {:.1f} GB/s = {:.2f} ms, {:.2f} GFLOP at "
               "{:.3f} TFLOP/s = {:.2f} ms ({} copies of the expert weights): the forward at "
               "{:.1f}% of it\n",
               r.fwd_weight_bytes / 1e6, r.roof.read_gbps,
               r.fwd_weight_bytes / (r.roof.read_gbps * 1e6), r.fwd_flops / 1e9,
               r.roof.dense_tflops, r.fwd_flops / (r.roof.dense_tflops * 1e9), r.copies,
               100 * r.fwd_floor_ms() / r.fwd.median_ms);
    // "name value, ..." over the steps whose value(s) is positive, each value as shown(value).
    auto join_steps = [](auto value, auto shown) {
      std::string out;
      for (int s = 0; s < kMoeSteps; ++s) {
        if (value(s) <= 0) continue;
        out += fmt::format("{}{} {}", out.empty() ? "" : ", ",
                           moe_step_name(static_cast<MoeStep>(s)), shown(value(s)));
      }
      return out;
    };
    if (r.fwd_packed.median_ms > 0) {
      fmt::print(f,
                 "forward on packed expert weights (expert_weights_packed), in the same loop: "
                 "{:.2f} ms, {:.1f}% of the floor, {:.2f}x the forward's speed (steps, ms: {})\n",
                 r.fwd_packed.median_ms, 100 * r.fwd_floor_ms() / r.fwd_packed.median_ms,
                 r.fwd.median_ms / r.fwd_packed.median_ms,
                 join_steps([&](int s) { return r.fwd_steps_packed[s]; },
                            [](double ms) { return fmt::format("{:.2f}", ms); }));
    }
    const std::string steps =
        join_steps([&](int s) { return r.step_share_of_floor(s); },
                   [](double share) { return fmt::format("{:.1f}%", 100 * share); });
    fmt::print(f,
               "forward steps against their own floor (their weights or FLOPs, the same rates): "
               "{}\n",
               steps);
  }
}

// {step name: ms} over the steps that took time.
nlohmann::json steps_json(const std::array<double, kMoeSteps>& ms) {
  nlohmann::json steps = nlohmann::json::object();
  for (int s = 0; s < kMoeSteps; ++s) {
    if (ms[s] > 0) steps[moe_step_name(static_cast<MoeStep>(s))] = ms[s];
  }
  return steps;
}

nlohmann::json result_json(const Result& r, DType dt, const Options& o, bool backward) {
  const nlohmann::json steps = steps_json(backward ? r.bwd_steps : r.fwd_steps);
  const Timing& t = backward ? r.bwd : r.fwd;
  const double gmm_flops = (backward ? 2 : 1) * r.gmm_flops_fwd;
  nlohmann::json j{{"op", "layer"},
                   {"pass", backward ? "bwd" : "fwd"},
                   {"preset", r.preset},
                   {"tokens", r.tokens},
                   {"experts", r.experts},
                   {"stands_for_tokens", r.stands_for},
                   {"device", o.device},
                   {"rows", r.rows},
                   {"dtype", std::string(dtype_name(dt))},
                   {"capacity_factor", o.capacity_factor},
                   {"expert_weights_transposed", o.weights_transposed},
                   {"ms", t.median_ms},
                   {"min_ms", t.min_ms},
                   {"steps_ms", steps},
                   {"tokens_per_s", 1e3 * r.tokens / t.median_ms},
                   {"gmm_tflops", gmm_flops / (t.median_ms * 1e9)},
                   {"dense_tflops", r.dense_tflops},
                   {"dense_impl", r.dense_impl},
                   {"fwd_bwd_ratio_to_dense", r.ratio()},
                   {"fwd_bwd_ratio_to_dense_with_shared", r.ratio_with_shared()}};
  if (!backward && r.fwd_packed.median_ms > 0) {
    j["packed_weights_ms"] = r.fwd_packed.median_ms;
    j["packed_weights_steps_ms"] = steps_json(r.fwd_steps_packed);
  }
  if (o.invariant) {
    j["invariant_ms"] = (backward ? r.bwd_inv : r.fwd_inv).median_ms;
    j["fwd_bwd_invariant_rate"] = r.invariant_rate();
  }
  if (!backward && r.has_floor()) {
    j.update(
        floor_json(r.roof, r.fwd_weight_bytes, r.fwd_flops, r.fwd.median_ms, o.cache, r.copies));
    nlohmann::json shares = nlohmann::json::object(), bytes = nlohmann::json::object();
    for (int s = 0; s < kMoeSteps; ++s) {
      const double share = r.step_share_of_floor(s);
      if (share <= 0) continue;
      shares[moe_step_name(static_cast<MoeStep>(s))] = share;
      bytes[moe_step_name(static_cast<MoeStep>(s))] = r.step_weight_bytes[s];
    }
    j["steps_share_of_floor"] = shares;
    j["steps_weight_bytes"] = bytes;
  }
  return j;
}

int run(const Options& o) {
  if (o.invariant && o.device != "cpu") {
    throw CLI::ValidationError("--invariant", "the batch-invariant mode runs on the CPU only");
  }
  if (o.packed && (o.device != "cpu" || (o.dtype != "bf16" && o.dtype != "f32") ||
                   o.weights_transposed || o.ep > 0)) {
    throw CLI::ValidationError("--packed-weights",
                               "packed weights serve the layer's bf16 and f32 forward on the CPU, "
                               "timed here on one rank: --dtype bf16 or f32, no "
                               "--expert-weights-transposed or --ep");
  }
  if (o.ep > 0) {
    if (o.invariant) throw CLI::ValidationError("--invariant", "not with --ep (yet)");
    if (o.device != "cpu") throw CLI::ValidationError("--ep", "the layer over ranks runs on CPUs");
    run_layer_ep(o);
    return 0;
  }
  const std::vector<const Preset*> todo = presets_of(o.preset);
  const DType dt = parse_dtype(o.dtype);
  const std::unique_ptr<BenchDevice> dev = make_bench_device(o.device);
  std::FILE* text = o.json ? stderr : stdout;  // --json keeps stdout for the JSON array
  fmt::print(
      text,
      "moekit bench layer  dtype={}  experts' weights {}  {}  SwiGLU, aux loss coeff {}, {}  "
      "{}  {}\n",
      dtype_name(dt), o.weights_transposed ? "[E, out, in]" : "[E, in, out]",
      o.capacity_factor > 0 ? fmt::format("capacity factor {}", o.capacity_factor)
                            : std::string("dropless"),
      o.aux_loss_coeff,
      "median of " + std::to_string(o.reps) + " runs after " + std::to_string(o.warmup) +
          " warm-up, interleaved with dense",
      dev->description(), today_iso());

  Progress progress(static_cast<int>(todo.size() * o.tokens.size()));
  std::vector<Result> results;
  std::vector<std::string> skipped;
  for (const Preset* p : todo) {
    for (int64_t T : o.tokens) {
      progress.step(fmt::format("{} T={}: forward, backward, dense (interleaved)", p->name, T));
      Result r;
      std::string why, note;
      if (run_one(*dev, *p, T, o, dt, r, why, note)) {
        if (!note.empty()) fmt::print(text, "{}\n", note);
        results.push_back(r);
      } else {
        skipped.push_back(why);
      }
    }
  }
  progress.finish();
  for (const Result& r : results) {
    print_result(text, r, *find_preset(r.preset), dt, o.invariant);
  }
  for (const std::string& s : skipped) fmt::print(text, "\nskipped {}\n", s);
  if (results.size() > 1) {
    std::vector<std::string> labels;
    std::vector<double> ratio;
    for (const Result& r : results) {
      labels.push_back(fmt::format("{} T={}{}", r.preset, r.tokens,
                                   r.experts != find_preset(r.preset)->E
                                       ? fmt::format(" (E={}, for T={})", r.experts, r.stands_for)
                                       : ""));
      ratio.push_back(100 * r.ratio());
    }
    fmt::print(text, "\nforward+backward against the dense rate (higher is better)\n{}",
               ascii_bars(labels, ratio, "% of dense"));
    if (results.front().has_floor()) {
      std::vector<double> share;
      for (const Result& r : results) share.push_back(100 * r.fwd_floor_ms() / r.fwd.median_ms);
      fmt::print(text, "\nforward against its floor (100% = at the floor)\n{}",
                 ascii_bars(labels, share, "% of floor"));
    }
  }
  fmt::print(text,
             "\n% of dense: (6 N H F forward + 12 N H F backward FLOPs) at the dense matmuls' "
             "rate, over the layer's forward + backward time. Steps' rates: TF/s for the matmuls, "
             "GB/s (rows read + written) for the memory-bound steps.\n");
  if (o.json) {
    nlohmann::json arr = nlohmann::json::array();
    for (const Result& r : results) {
      arr.push_back(result_json(r, dt, o, false));
      arr.push_back(result_json(r, dt, o, true));
    }
    fmt::print("{}\n", arr.dump(1));
  }
  return 0;
}

}  // namespace

MoeLayerConfig preset_config(const Preset& p, const LayerOptions& o, std::vector<float>& bias) {
  MoeLayerConfig c;
  c.hidden = p.H, c.ffn = p.F, c.num_experts = p.E;
  c.route = preset_route_options(p, o.seed, bias);
  c.shared_ffn = p.shared_experts * p.F;
  c.activation = Activation::kSwiGLU;
  c.capacity_factor = o.capacity_factor;
  c.aux_loss_coeff = o.aux_loss_coeff;
  c.expert_weights_transposed = o.weights_transposed;
  return c;
}

std::vector<const Preset*> presets_of(const std::string& name) {
  std::vector<const Preset*> todo;
  if (name == "all") {
    for (const Preset& p : presets()) todo.push_back(&p);
  } else if (const Preset* p = find_preset(name)) {
    todo.push_back(p);
  } else {
    throw CLI::ValidationError("--preset",
                               "unknown preset '" + name + "'; known: all, " + preset_names());
  }
  return todo;
}

void register_bench_layer(CLI::App& bench) {
  auto opts = std::make_shared<Options>();
  CLI::App* cmd = bench.add_subcommand(
      "layer",
      "Time the MoE layer's forward and backward, step by step, against dense oneDNN or cuBLAS");
  opts->preset = "qwen3-30b-a3b";
  opts->tokens = {4096};
  opts->dtype = "bf16";
  opts->warmup = 1;
  opts->reps = 3;
  add_bench_options(
      *cmd, *opts, "Activation and weight dtype: bf16 | f32",
      "Run a stated subset of a preset's experts where its buffers would exceed this");
  add_device_option(*cmd, opts->device);
  cmd->add_option("--capacity-factor", opts->capacity_factor,
                  "Drop tokens past this capacity factor (0: dropless)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--aux-loss-coeff", opts->aux_loss_coeff, "Load-balancing loss coefficient")
      ->capture_default_str();
  cmd->add_option("--cache", opts->cache,
                  "cold: cycle through copies of the expert weights where one forward's would "
                  "stay cached, as a model's layers do (CPU); warm: one copy")
      ->check(CLI::IsMember({"cold", "warm"}))
      ->capture_default_str();
  add_cache_size_option(*cmd);
  cmd->add_flag("--expert-weights-transposed", opts->weights_transposed,
                "The experts' weights stored [E, out, in], each a linear layer's weight "
                "(MoeLayerConfig::expert_weights_transposed), the dense references and the floor's "
                "dense rate in that layout");
  cmd->add_flag("--packed-weights", opts->packed,
                "Also time the forward on the experts' weights packed (pack_ragged_rhs, "
                "MoeLayerConfig::expert_weights_packed), in the same loop (CPU, bf16 or f32)");
  cmd->add_flag("--invariant", opts->invariant,
                "Also time the batch-invariant mode (MoeLayerConfig::batch_invariant), in the "
                "same loop");
  cmd->add_option("--ep", opts->ep,
                  "Run the layer over this many ranks, --tokens each (mpiexec -n P, or the "
                  "threads engine), beside the one-rank layer on all their tokens")
      ->check(CLI::Range(1, 1024));
  add_ep_group_options(*cmd, opts->group);
  cmd->callback([opts] { run(*opts); });
}

}  // namespace moekit::tools
