// The floor of a weight-streaming op on this machine (issue 35): a call cannot take less than
// max(the bytes it must read / the memory's read rate, its FLOPs / the dense matmul rate), both
// rates measured in the same run as the op. And the cold-weights mode: enough copies of the
// weights, cycled call by call, that every call reads its weights from memory, as a model's
// layers do, instead of finding them in the cache where they would fit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace moekit::tools {

// The largest cache's size: set_last_level_cache_bytes's, else sysfs's, else sysconf's; 32 MiB
// where none says.
size_t last_level_cache_bytes();
// Overrides what the machine reports (0: back to the machine's). A virtual machine's sysfs may
// name its host's whole L3 (480 MiB on a 2-core Xeon VM whose reads run at memory speed from
// ~128 MiB); the benches' --cache-mib sets this.
void set_last_level_cache_bytes(size_t bytes);

// Copies of the weights to cycle through so that the `touched` bytes a call reads come from
// memory: enough that the copies' touched bytes together are at least 4 times the last-level
// cache (1 where one call's already are).
int64_t cold_copies(double touched_bytes);

struct Roofline {
  double read_gbps = 0;     // a plain parallel read much larger than the caches (FloorRead)
  double dense_tflops = 0;  // a dense matmul large enough to be compute-bound

  // The floor in ms of a call reading `bytes` and doing `flops`, and which of the two binds it.
  double floor_ms(double bytes, double flops) const;
  const char* bound(double bytes, double flops) const;
};

// The JSON keys of a case's floor, every bench alike: weight_bytes, flops, read_gbps,
// dense_peak_tflops, floor_ms, bound, share_of_floor (of a call of `ms`), cache, weight_copies.
nlohmann::json floor_json(const Roofline& roof, double bytes, double flops, double ms,
                          const std::string& cache, int64_t copies);

// Bytes of a buffer for the read-rate measurement: 8 times the last-level cache, at least 256 MiB.
size_t read_probe_bytes();

}  // namespace moekit::tools
