// moekit bench layer: the one-rank layer against dense matmuls (bench_layer.cpp), and with
// --ep P the layer over P ranks against the one-rank layer (bench_layer_ep.cpp).
#pragma once

#include <array>
#include <string>
#include <vector>

#include "bench_common.h"
#include "ep_group.h"
#include "moekit/layer.h"
#include "presets.h"

namespace moekit::tools {

struct LayerOptions : BenchOptions {
  double capacity_factor = 0;
  float aux_loss_coeff = 0.01f;
  int ep = 0;                       // > 0: the layer over this many ranks
  bool invariant = false;           // also time the batch-invariant mode
  std::string cache = "cold";       // cold: cycle through copies of the expert weights (CPU)
  bool weights_transposed = false;  // MoeLayerConfig::expert_weights_transposed
  bool packed =
      false;  // also the forward on packed weights (MoeLayerConfig::expert_weights_packed)
  EpGroupOptions group;
};

// One expert's weight [in, out] as the config lays it out: {in, out}, or {out, in} with
// expert_weights_transposed.
inline std::array<int64_t, 2> expert_matrix(const MoeLayerConfig& c, int64_t in, int64_t out) {
  if (c.expert_weights_transposed) return {out, in};
  return {in, out};
}

inline constexpr double kGiB = 1ull << 30;

// The preset's layer: its H, F, E, routing and shared experts, SwiGLU, the options' capacity and
// load-balancing coefficient. The expert bias, when the preset has one, is drawn into `bias`.
MoeLayerConfig preset_config(const Preset& p, const LayerOptions& o, std::vector<float>& bias);

// The presets --preset names: one, or every one for "all" (a CLI::ValidationError otherwise).
std::vector<const Preset*> presets_of(const std::string& name);

// --ep P (bench_layer_ep.cpp).
void run_layer_ep(const LayerOptions& o);

}  // namespace moekit::tools
