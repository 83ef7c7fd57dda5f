// moekit bench ragged_dot --device cuda in a build without the CUDA backend.
#include <stdexcept>

#include "bench_ragged_dot.h"

namespace moekit::tools {

std::string time_ragged_dot_cuda(const RaggedDotBenchOptions&, const Preset&, DType, DType, int,
                                 std::FILE*, Progress&, std::vector<RaggedDotRow>&) {
  throw std::runtime_error("--device cuda: this moekit was built without its CUDA backend");
}

}  // namespace moekit::tools
