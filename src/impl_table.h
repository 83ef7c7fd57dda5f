// Internal: the implementation table of an op. Each public entry point lists its
// implementations fastest first and the reference last; kAuto takes the first.
#pragma once

#include <cstddef>
#include <string>

#include "moekit/status.h"

namespace moekit::detail {

template <typename Impl, typename Problem>
struct Implementation {
  Impl id;
  Status (*run)(const Problem&);
};

// Runs the first implementation in `table` that `want` allows (Impl::kAuto: the first).
template <typename Impl, typename Problem, size_t N>
Status run_implementation(const char* op, const Implementation<Impl, Problem> (&table)[N],
                          Impl want, const Problem& problem) {
  for (const auto& impl : table) {
    if (want == Impl::kAuto || want == impl.id) return impl.run(problem);
  }
  return Status::invalid_argument(op, "impl", std::to_string(static_cast<int>(want)),
                                  "not an implementation of this op");
}

}  // namespace moekit::detail
