// The model presets of SPEC.md section 6, read from bench/presets.json (compiled in).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "moekit/router.h"

namespace moekit::tools {

struct Preset {
  std::string name;
  int64_t H = 0;      // hidden size
  int64_t F = 0;      // per-expert FFN width
  int64_t E = 0;      // experts
  int64_t k = 0;      // experts per token
  std::string score;  // softmax | sigmoid | sqrtsoftplus
  bool pre_softmax = false;
  int64_t shared_experts = 0;
  int64_t num_groups = 0, group_topk = 0;  // 0: no group-limited routing
  double scaling_factor = 1.0;
  bool expert_bias = false;
};

const std::vector<Preset>& presets();
// nullptr when no preset has that name.
const Preset* find_preset(std::string_view name);
std::string preset_names();

// The preset's router options. Its expert bias, when it has one, is drawn once from seed into
// `bias` (small against the scores, as after training); the options point into it.
RouteOptions preset_route_options(const Preset& p, uint64_t seed,
                                  std::vector<float>& bias);  // "a, b, c" for help and error texts

}  // namespace moekit::tools
