// moekit bench router: times the route forward and backward, the aux-loss scores, the
// load-balancing loss and the z-loss on a preset's own routing (SPEC.md section 6), each beside
// a copy of the same number of bytes on the same device (--device: both cores' parallel_copy, or
// a device-to-device cudaMemcpyAsync), run by run in the same process. GB/s counts the nominal
// bytes of the tensors each call reads and writes.
#include <fmt/format.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <random>

#include "bench_common.h"
#include "bench_copy.h"
#include "bench_device.h"
#include "benches.h"
#include "moekit/router.h"
#include "presets.h"

namespace moekit::tools {
namespace {

std::string routing_description(const Preset& p) {
  std::string s = p.score;
  if (p.score == "softmax") s += p.pre_softmax ? " pre" : " post";
  if (p.num_groups > 0) s += fmt::format(", {} groups top-{}", p.num_groups, p.group_topk);
  if (p.expert_bias) s += ", bias";
  if (p.scaling_factor != 1.0) s += fmt::format(", scale {}", p.scaling_factor);
  return s;
}

int run(const BenchOptions& o) {
  const Preset* p = find_preset(o.preset);
  if (!p) {
    throw CLI::ValidationError("--preset",
                               "unknown preset '" + o.preset + "'; known: " + preset_names());
  }
  const DType in = parse_dtype(o.dtype);
  const int64_t E = p->E;
  const int32_t k = static_cast<int32_t>(p->k);
  const std::unique_ptr<BenchDevice> dev = make_bench_device(o.device);

  std::FILE* text = o.json ? stderr : stdout;  // --json keeps stdout for the JSON array
  fmt::print(text, "moekit bench router  preset={} (E={} k={}, {})  logits={}  {}  {}\n", p->name,
             E, k, routing_description(*p), dtype_name(in), dev->description(), today_iso());

  std::vector<float> bias;
  RouteOptions ro = preset_route_options(*p, o.seed, bias);
  const Mem bias_mem = place_expert_bias(*dev, ro);
  const RouterScore score = ro.score;

  const size_t kCases = 8;  // per token count, for the progress line
  Progress progress(static_cast<int>(o.tokens.size()) * kCases);
  std::vector<CopyRow> rows;
  for (int64_t T : o.tokens) {
    const size_t in_es = dtype_size(in);
    // Router tensors, on the device. Gradients come in f32 and go out in the logits dtype.
    Mem logits = dev->alloc(T * E * in_es), probs = dev->alloc(T * E * 4), map = dev->alloc(T * E),
        idx = dev->alloc(T * k * 4), w = dev->alloc(T * k * 4);
    Mem d_w = dev->alloc(T * k * 4), d_logits = dev->alloc(T * E * in_es),
        scores = dev->alloc(T * E * 4), aux_map = dev->alloc(T * E);
    Mem d_scores = dev->alloc(T * E * 4), tpe = dev->alloc(E * 4), loss = dev->alloc(4);
    dev->fill(logits.data(), in, T * E, o.seed + 1);
    dev->fill(d_w.data(), DType::kF32, T * k, o.seed + 2);
    dev->fill(d_scores.data(), DType::kF32, T * E, o.seed + 3);
    const Exec exec = dev->exec(dev->alloc(router_workspace_size(dev->device(), T, E)));

    const ConstTensorView logits_v(logits.data(), in, {T, E});
    const RouteOutputs outs{
        TensorView(probs.data(), DType::kF32, {T, E}), TensorView(map.data(), DType::kBool, {T, E}),
        TensorView(idx.data(), DType::kI32, {T, k}), TensorView(w.data(), DType::kF32, {T, k})};
    const TensorView d_logits_v(d_logits.data(), in, {T, E});
    const TensorView scores_v(scores.data(), DType::kF32, {T, E});
    const TensorView aux_map_v(aux_map.data(), DType::kBool, {T, E});
    const TensorView tpe_v(tpe.data(), DType::kI32, {E});
    const TensorView d_scores_v(d_scores.data(), DType::kF32, {T, E});
    float* loss_p = static_cast<float*>(loss.data());
    // The routing the backward and the losses start from.
    check(route(logits_v, ro, outs, exec));
    check(aux_loss_scores(logits_v, k, score, scores_v, aux_map_v, RouterImpl::kAuto, exec));
    check(count_tokens_per_expert(aux_map_v, tpe_v, exec));
    const LoadBalancingOptions lb{k, 1e-2f, 0};

    const double tE = static_cast<double>(T * E), tk = static_cast<double>(T * k);
    const double lg = tE * in_es;  // logits bytes
    const std::vector<CopyCase> cases = {
        {"route", "fwd", lg + tE * 4 + tE + tk * 8,
         [&] { check(route(logits_v, ro, outs, exec)); }},
        {"route", "bwd", lg + tk * 8 + lg,
         [&] {
           check(route_backward(logits_v, outs.topk_indices, {},
                                ConstTensorView(d_w.data(), DType::kF32, {T, k}), ro, d_logits_v,
                                exec));
         }},
        {"aux_scores", "fwd", lg + tE * 4 + tE,
         [&] {
           check(aux_loss_scores(logits_v, k, score, scores_v, aux_map_v, RouterImpl::kAuto, exec));
         }},
        {"aux_scores", "bwd", lg + tE * 4 + lg,
         [&] {
           check(aux_loss_scores_backward(logits_v, d_scores_v, score, d_logits_v,
                                          RouterImpl::kAuto, exec));
         }},
        {"load_balancing_loss", "fwd", tE * 4,
         [&] { check(load_balancing_loss(scores_v, tpe_v, lb, loss_p, exec)); }},
        {"load_balancing_loss", "bwd", tE * 4,
         [&] { check(load_balancing_loss_backward(tpe_v, lb, 1.0f, d_scores_v, exec)); }},
        {"z_loss", "fwd", lg, [&] { check(z_loss(logits_v, 1e-3f, loss_p, exec)); }},
        {"z_loss", "bwd", lg + lg,
         [&] { check(z_loss_backward(logits_v, 1e-3f, 1.0f, d_logits_v, exec)); }},
    };
    if (cases.size() != kCases) throw std::logic_error("bench router: kCases is out of date");

    time_against_copy(*dev, cases, T, fmt::format("{} T={}", p->name, T), o.warmup, o.reps,
                      o.seed + 4, progress, rows);
  }
  progress.finish();

  print_copy_table(text, *dev, rows, o.warmup, o.reps,
                   "Bytes are the nominal sizes of the tensors read and written: route fwd logits "
                   "+ probs (f32) + routing_map + topk indices and weights; bwd logits + topk "
                   "indices + d_topk_weights + d_logits.");

  if (o.json) {
    nlohmann::json arr = nlohmann::json::array();
    for (const CopyRow& r : rows) {
      nlohmann::json j = copy_row_json(r);
      j.update({{"op", "router"},
                {"preset", p->name},
                {"device", o.device},
                {"E", E},
                {"k", k},
                {"dtype", std::string(dtype_name(in))}});
      arr.push_back(j);
    }
    fmt::print("{}\n", arr.dump(1));
  }
  return 0;
}

}  // namespace

void register_bench_router(CLI::App& bench) {
  auto opts = std::make_shared<BenchOptions>(BenchOptions{"deepseek-v3", {16384}, "f32"});
  CLI::App* cmd = bench.add_subcommand(
      "router", "Time the router and its losses against a copy of the same bytes (CPU or GPU)");
  add_bench_options(*cmd, *opts, "Logits dtype: f32 | bf16");
  add_device_option(*cmd, opts->device);
  cmd->callback([opts] { run(*opts); });
}

}  // namespace moekit::tools
