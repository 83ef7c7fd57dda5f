#include "roofline.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>

namespace moekit::tools {

// The largest cache level sysfs lists for cpu0 ("32768K"): what this machine's cores share. (On a
// virtual machine sysconf may report the host socket's whole L3: 384 MiB where sysfs says 32.)
size_t sysfs_last_level_cache_bytes() {
  int best_level = 0;
  size_t best = 0;
  for (int i = 0; i < 16; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream level_f(dir + "level"), size_f(dir + "size");
    int level = 0;
    std::string size;
    if (!(level_f >> level) || !(size_f >> size) || size.empty()) continue;
    size_t bytes = std::strtoull(size.c_str(), nullptr, 10);
    if (size.back() == 'K') bytes <<= 10;
    if (size.back() == 'M') bytes <<= 20;
    if (level > best_level) best_level = level, best = bytes;
  }
  return best;
}

namespace {
size_t g_cache_bytes = 0;  // set_last_level_cache_bytes's value; 0: ask the machine
}  // namespace

void set_last_level_cache_bytes(size_t bytes) { g_cache_bytes = bytes; }

size_t last_level_cache_bytes() {
  if (g_cache_bytes > 0) return g_cache_bytes;
  if (const size_t bytes = sysfs_last_level_cache_bytes(); bytes > 0) return bytes;
  for (int name : {_SC_LEVEL3_CACHE_SIZE, _SC_LEVEL2_CACHE_SIZE}) {
    const long bytes = sysconf(name);
    if (bytes > 0) return static_cast<size_t>(bytes);
  }
  return size_t{32} << 20;
}

int64_t cold_copies(double touched_bytes) {
  if (touched_bytes <= 0) return 1;
  const double want = 4.0 * static_cast<double>(last_level_cache_bytes());
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(want / touched_bytes)));
}

double Roofline::floor_ms(double bytes, double flops) const {
  const double mem = read_gbps > 0 ? bytes / (read_gbps * 1e6) : 0;
  const double mma = dense_tflops > 0 ? flops / (dense_tflops * 1e9) : 0;
  return std::max(mem, mma);
}

const char* Roofline::bound(double bytes, double flops) const {
  const double mem = read_gbps > 0 ? bytes / (read_gbps * 1e6) : 0;
  const double mma = dense_tflops > 0 ? flops / (dense_tflops * 1e9) : 0;
  return mem >= mma ? "memory" : "compute";
}

nlohmann::json floor_json(const Roofline& roof, double bytes, double flops, double ms,
                          const std::string& cache, int64_t copies) {
  const double floor = roof.floor_ms(bytes, flops);
  return {{"weight_bytes", bytes},
          {"flops", flops},
          {"read_gbps", roof.read_gbps},
          {"dense_peak_tflops", roof.dense_tflops},
          {"floor_ms", floor},
          {"bound", roof.bound(bytes, flops)},
          {"share_of_floor", floor / ms},
          {"cache", cache},
          {"weight_copies", copies}};
}

size_t read_probe_bytes() { return std::max(size_t{256} << 20, 8 * last_level_cache_bytes()); }

}  // namespace moekit::tools
