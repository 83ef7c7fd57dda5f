// Internal: the implementation table of an op. Each public entry point lists its
// implementations in order of preference; kAuto takes the first that takes the call.
#pragma once

#include <fmt/format.h>

#include <cstddef>

#include "moekit/exec.h"
#include "moekit/status.h"

namespace moekit::detail {

// The predicates of the tables: where the problem's buffers live (every problem carries the
// call's Exec as `exec`).
template <class Problem>
bool on_cpu(const Problem& p) {
  return p.exec.device == Device::kCpu;
}
template <class Problem>
bool on_cuda(const Problem& p) {
  return p.exec.device == Device::kCuda;
}
inline constexpr const char* kCpuNeeds = "host buffers (Exec::device = kCpu)";
inline constexpr const char* kCudaNeeds = "CUDA buffers (Exec::device = kCuda)";

template <typename Impl, typename Problem>
struct Implementation {
  Impl id;
  Status (*run)(const Problem&);
  // Whether it takes this call (null: every call), and what it needs, for the error when it was
  // asked for by name and does not.
  bool (*takes)(const Problem&) = nullptr;
  const char* needs = "";
  // Whether kAuto picks it for a call it takes (null: every such call): a shape where another
  // implementation further down the table runs faster.
  bool (*picks)(const Problem&) = nullptr;
};

// Runs the first implementation in `table` that takes the problem and picks it (want ==
// Impl::kAuto), or the one named by `want`, writing its id to *ran first (when ran is set); the
// errors name it by impl_name (the op's public header declares it for its Impl).
template <typename Impl, typename Problem, size_t N>
Status run_implementation(const char* op, const Implementation<Impl, Problem> (&table)[N],
                          Impl want, const Problem& problem, Impl* ran = nullptr) {
  auto run = [&](const Implementation<Impl, Problem>& impl) {
    if (ran != nullptr) *ran = impl.id;
    return impl.run(problem);
  };
  for (const auto& impl : table) {
    const bool takes = impl.takes == nullptr || impl.takes(problem);
    if (want == Impl::kAuto && takes && (impl.picks == nullptr || impl.picks(problem)))
      return run(impl);
    if (want != impl.id) continue;
    if (!takes) {
      return Status::unimplemented(op, fmt::format("impl {} does not take this call: it needs {}",
                                                   impl_name(want), impl.needs));
    }
    return run(impl);
  }
  if (want == Impl::kAuto) return Status::unimplemented(op, "no implementation takes this call");
  return Status::invalid_argument(op, "impl",
                                  fmt::format("{} ({})", impl_name(want), static_cast<int>(want)),
                                  "not an implementation of this op");
}

}  // namespace moekit::detail
