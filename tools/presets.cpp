#include "presets.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

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

}  // namespace moekit::tools
