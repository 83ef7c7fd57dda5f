// Internal: how the CUDA kernels read device-resident group sizes and offsets that the host never
// checked. Plain functions of host and device, so that the CPU tests pin the rules down too:
// a negative size counts as 0, the offset is clamped into [0, G - E_loc], and a group's rows are
// clipped to [0, m), so no kernel reads or writes a row outside the tensors whatever the sizes.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MOEKIT_HOST_DEVICE __host__ __device__
#else
#define MOEKIT_HOST_DEVICE
#endif

namespace moekit::detail::cuda {

MOEKIT_HOST_DEVICE inline int64_t clamp_group_size(int32_t size) { return size < 0 ? 0 : size; }

// Requires num_groups >= num_local (checked on the host, where both are known).
MOEKIT_HOST_DEVICE inline int64_t clamp_group_offset(int64_t offset, int64_t num_groups,
                                                     int64_t num_local) {
  const int64_t hi = num_groups - num_local;
  return offset < 0 ? 0 : (offset > hi ? hi : offset);
}

struct RowRange {
  int64_t begin, end;
};

// The rows [start, start + size) of a group, clipped to [0, m); start >= 0.
MOEKIT_HOST_DEVICE inline RowRange clip_rows(int64_t start, int64_t size, int64_t m) {
  const int64_t begin = start < m ? start : m;
  const int64_t end = start + size < m ? start + size : m;
  return RowRange{begin, end};
}

}  // namespace moekit::detail::cuda
