// Internal: copies that write with non-temporal stores, for outputs larger than the caches
// (stream_bytes is defined with the router's vector code in router_simd.cpp, dispatched at run
// time), and prefetching.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "moekit/view.h"

namespace moekit::detail {

// dst[0, bytes) = src[0, bytes), with non-temporal stores for the vector-aligned whole vectors of
// dst (plain stores for the unaligned ends). A thread calls stream_fence() before others read what
// it streamed.
void stream_bytes(void* dst, const void* src, size_t bytes);
void stream_fence();

// Outputs at least this large are written with non-temporal stores: they do not fit in the
// caches anyway, and streaming them saves reading every line before overwriting it.
inline constexpr int64_t kStreamBytes = 4 << 20;

// Whether an output is worth streaming; decided once per call, not per row.
inline bool worth_streaming(const ConstTensorView& v) {
  return v.data != nullptr && v.numel() * static_cast<int64_t>(dtype_size(v.dtype)) >= kStreamBytes;
}

// Writes a finished row: `bytes` from src to dst, streamed or plain.
inline void write_row(void* dst, const void* src, size_t bytes, bool stream) {
  if (stream) {
    stream_bytes(dst, src, bytes);
  } else {
    std::memcpy(dst, src, bytes);
  }
}

// Asks for the cache lines of `bytes` at p (nullptr: nothing) ahead of their use, where the
// hardware prefetchers do not see the access pattern soon enough.
inline void prefetch_bytes(const void* p, size_t bytes) {
  if (!p) return;
  for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b);
}

}  // namespace moekit::detail
