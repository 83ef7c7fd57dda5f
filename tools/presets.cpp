#include "presets.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>
#include <random>
#include <stdexcept>

namespace moekit::tools {

extern const char kPresetsJson[];

const std::vector<Preset>& presets() {
  static const std::vector<Preset> all = [] {
    std::vector<Preset> out;
    const auto doc = nlohmann::json::parse(kPresetsJson);
    for (const auto& j : doc.at("presets")) {
      Preset p;
      p.name = j.at("name").get<std::string>();
      p.H = j.at("H").get<int64_t>();
      p.F = j.at("F").get<int64_t>();
      p.E = j.at("E").get<int64_t>();
      p.k = j.at("k").get<int64_t>();
      p.score = j.at("score").get<std::string>();
      p.pre_softmax = j.value("pre_softmax", false);
      p.shared_experts = j.value("shared_experts", int64_t{0});
      p.num_groups = j.value("num_groups", int64_t{0});
      p.group_topk = j.value("group_topk", int64_t{0});
      p.scaling_factor = j.value("scaling_factor", 1.0);
      p.expert_bias = j.value("expert_bias", false);
      out.push_back(std::move(p));
    }
    return out;
  }();
  return all;
}

const Preset* find_preset(std::string_view name) {
  for (const auto& p : presets()) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

std::string preset_names() {
  std::vector<std::string> names;
  for (const auto& p : presets()) names.push_back(p.name);
  return fmt::format("{}", fmt::join(names, ", "));
}

RouteOptions preset_route_options(const Preset& p, uint64_t seed, std::vector<float>& bias) {
  RouteOptions ro;
  if (p.score == "softmax") {
    ro.score = RouterScore::kSoftmax;
  } else if (p.score == "sigmoid") {
    ro.score = RouterScore::kSigmoid;
  } else if (p.score == "sqrtsoftplus") {
    ro.score = RouterScore::kSqrtSoftplus;
  } else {
    throw std::runtime_error("presets.json: unknown score '" + p.score + "'");
  }
  ro.k = static_cast<int32_t>(p.k);
  ro.pre_softmax = p.pre_softmax;
  ro.num_groups = static_cast<int32_t>(p.num_groups);
  ro.group_topk = static_cast<int32_t>(p.group_topk);
  ro.scaling_factor = static_cast<float>(p.scaling_factor);
  bias.clear();
  if (p.expert_bias) {
    std::mt19937 rng(static_cast<uint32_t>(seed));
    std::uniform_real_distribution<float> u(-0.05f, 0.05f);
    for (int64_t e = 0; e < p.E; ++e) bias.push_back(u(rng));
  }
  ro.expert_bias = bias;
  return ro;
}

}  // namespace moekit::tools
