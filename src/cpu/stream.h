// Internal: copies that write with non-temporal stores, for outputs larger than the caches
// (defined with the router's vector code in router_simd.cpp, dispatched at run time).
#pragma once

#include <cstddef>

namespace moekit::detail {

// dst[0, bytes) = src[0, bytes), with non-temporal stores for the vector-aligned whole vectors of
// dst (plain stores for the unaligned ends). A thread calls stream_fence() before others read what
// it streamed.
void stream_bytes(void* dst, const void* src, size_t bytes);
void stream_fence();

}  // namespace moekit::detail
