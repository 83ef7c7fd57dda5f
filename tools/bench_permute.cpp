// moekit bench permute: times permute and unpermute, forward and backward, on a preset's rows
// [T, H] and its own routing (SPEC.md section 6: the router of the preset on random logits, from
// topk_indices), each beside a copy of the same number of bytes on the same device (--device:
// both cores' parallel_copy, or a device-to-device cudaMemcpyAsync), run by run in the same
// process. GB/s counts the nominal bytes of the tensors each call reads and writes.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "bench_common.h"
#include "bench_copy.h"
#include "bench_device.h"
#include "benches.h"
#include "moekit/permute.h"
#include "moekit/router.h"
#include "presets.h"

namespace moekit::tools {
namespace {

int run(const BenchOptions& o) {
  const Preset* p = find_preset(o.preset);
  if (!p) {
    throw CLI::ValidationError("--preset",
                               "unknown preset '" + o.preset + "'; known: " + preset_names());
  }
  const DType dt = parse_dtype(o.dtype);
  const int64_t E = p->E, H = p->H;
  const int32_t k = static_cast<int32_t>(p->k);
  const std::unique_ptr<BenchDevice> dev = make_bench_device(o.device);
  std::FILE* text = o.json ? stderr : stdout;  // --json keeps stdout for the JSON array
  fmt::print(text, "moekit bench permute  preset={} (H={} E={} k={})  rows={}  {}  {}\n", p->name,
             H, E, k, dtype_name(dt), dev->description(), today_iso());

  std::vector<float> bias;
  RouteOptions ro = preset_route_options(*p, o.seed, bias);
  const Mem bias_mem = place_expert_bias(*dev, ro);
  const size_t kCases = 4;
  Progress progress(static_cast<int>(o.tokens.size() * kCases));
  std::vector<CopyRow> rows;
  for (int64_t T : o.tokens) {
    const int64_t N = T * k;  // dropless, unaligned: also permute_max_rows
    const size_t es = dtype_size(dt);
    const Exec exec = dev->exec(dev->alloc(permute_workspace_size(dev->device(), T, k, E, N)));
    // The routing: the preset's router on random logits.
    Mem logits = dev->alloc(T * E * 4), idx = dev->alloc(N * 4), w = dev->alloc(N * 4);
    dev->fill(logits.data(), DType::kF32, T * E, o.seed + 1);
    const TensorView idx_v(idx.data(), DType::kI32, {T, k});
    const TensorView w_v(w.data(), DType::kF32, {T, k});
    check(
        route(ConstTensorView(logits.data(), DType::kF32, {T, E}), ro, {{}, {}, idx_v, w_v}, exec));

    Mem x = dev->alloc(T * H * es), x_perm = dev->alloc(N * H * es), p_perm = dev->alloc(N * 4),
        tpe = dev->alloc(E * 4), row_map = dev->alloc(2 * N * 4);
    Mem out = dev->alloc(T * H * es), d_probs = dev->alloc(N * 4), d_y = dev->alloc(N * H * es);
    dev->fill(x.data(), dt, T * H, o.seed + 2);
    const ConstTensorView x_v(x.data(), dt, {T, H});
    const TensorView x_perm_v(x_perm.data(), dt, {N, H}), p_perm_v(p_perm.data(), DType::kF32, {N});
    const TensorView row_map_v(row_map.data(), DType::kI32, {2, T, k});
    const TensorView out_v(out.data(), dt, {T, H}), d_probs_v(d_probs.data(), DType::kF32, {T, k});
    const TensorView d_y_v(d_y.data(), dt, {N, H});
    const PermuteOutputs perm{
        x_perm_v, p_perm_v, TensorView(tpe.data(), DType::kI32, {E}), row_map_v, {}};
    check(permute(x_v, idx_v, w_v, {}, perm, exec));
    constexpr PermuteImpl kAuto = PermuteImpl::kAuto;

    // Nominal bytes: the [T, H] side, the [N, H] side, and the small per-slot tensors.
    const double small = static_cast<double>(N) * 4;  // one i32 or f32 per slot
    const double tokens_side = static_cast<double>(T * H * es), rows_side = tokens_side * k;
    const std::vector<CopyCase> cases = {
        {"permute", "fwd", tokens_side + rows_side + 5 * small,
         [&] { check(permute(x_v, idx_v, w_v, {}, perm, exec)); }},
        {"permute", "bwd", rows_side + tokens_side + 4 * small,
         [&] {
           check(permute_backward(x_perm_v, p_perm_v, row_map_v, out_v, d_probs_v, kAuto, exec));
         }},
        {"unpermute", "fwd", rows_side + tokens_side + 2 * small,
         [&] { check(unpermute(x_perm_v, row_map_v, w_v, out_v, kAuto, exec)); }},
        // With the merging-probs gradient: reads y_perm and d_out, writes d_y_perm and d_probs.
        {"unpermute", "bwd", tokens_side + 2 * rows_side + 3 * small,
         [&] {
           check(
               unpermute_backward(out_v, x_perm_v, row_map_v, w_v, d_y_v, d_probs_v, kAuto, exec));
         }},
    };
    if (cases.size() != kCases) throw std::logic_error("bench permute: kCases is out of date");
    time_against_copy(*dev, cases, T, fmt::format("{} T={}", p->name, T), o.warmup, o.reps,
                      o.seed + 3, progress, rows);
  }
  progress.finish();
  print_copy_table(text, *dev, rows, o.warmup, o.reps,
                   fmt::format("Bytes are the nominal sizes of the tensors read and written "
                               "(rows {}): permute fwd x + x_perm + indices, probs, row map; bwd "
                               "d_x_perm + d_x + per-slot tensors; unpermute fwd y_perm + out + "
                               "row map, weights; bwd d_out + y_perm + d_y_perm + per-slot "
                               "tensors.",
                               dtype_name(dt)));
  if (o.json) {
    nlohmann::json arr = nlohmann::json::array();
    for (const CopyRow& r : rows) {
      nlohmann::json j = copy_row_json(r);
      j.update({{"op", r.kernel},
                {"preset", p->name},
                {"device", o.device},
                {"H", H},
                {"E", E},
                {"k", k},
                {"dtype", std::string(dtype_name(dt))}});
      arr.push_back(j);
    }
    fmt::print("{}\n", arr.dump(1));
  }
  return 0;
}

}  // namespace

void register_bench_permute(CLI::App& bench) {
  auto opts = std::make_shared<BenchOptions>(BenchOptions{"qwen3-30b-a3b", {4096}, "bf16"});
  CLI::App* cmd = bench.add_subcommand(
      "permute", "Time permute and unpermute, forward and backward, against a copy");
  add_bench_options(*cmd, *opts, "Row dtype: f32 | bf16");
  add_device_option(*cmd, opts->device);
  cmd->callback([opts] { run(*opts); });
}

}  // namespace moekit::tools
