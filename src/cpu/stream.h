// Internal: copies that write with non-temporal stores, for outputs larger than the caches
// (stream_bytes in stream.cpp, dispatched at run time), and prefetching; the router and permute
// write their large outputs through them.
#pragma once

#include <algorithm>
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

// Finished output waiting to be streamed: whole 64-byte lines, handed to a long-running kernel
// that streams a few per step of its own work, so that the stores drain to memory while it
// computes instead of stalling it in a burst. push() writes the unaligned ends of a run at once
// (plain stores) and queues its aligned lines; src must stay unchanged until they are written.
struct StreamQueue {
  static constexpr int kMaxRuns = 64;
  static constexpr size_t kLine = 64;
  struct Run {
    char* dst;        // 64-byte aligned
    const char* src;  // any alignment
    size_t lines;
  };
  Run runs[kMaxRuns];
  int count = 0, next = 0;  // runs queued; the first not yet finished

  bool empty() const { return next == count; }
  // Queues dst[0, bytes) = src[0, bytes); when the queue is full, streams the run at once.
  void push(void* dst, const void* src, size_t bytes) {
    auto* d = static_cast<char*>(dst);
    const auto* s = static_cast<const char*>(src);
    const size_t head = std::min(bytes, (kLine - reinterpret_cast<uintptr_t>(d) % kLine) % kLine);
    const size_t lines = (bytes - head) / kLine, body = lines * kLine;
    std::memcpy(d, s, head);
    std::memcpy(d + head + body, s + head + body, bytes - head - body);
    if (lines == 0) return;
    if (count == kMaxRuns) {
      stream_bytes(d + head, s + head, body);
      return;
    }
    runs[count++] = {d + head, s + head, lines};
  }
  // Streams everything still queued.
  void flush() {
    for (; next < count; ++next) {
      stream_bytes(runs[next].dst, runs[next].src, runs[next].lines * kLine);
    }
    count = next = 0;
  }
};

// Fetches the cache line at p into L1 and L2 (kL1: prefetcht0) or L2 (prefetcht1). An asm
// statement, which the compiler keeps: GCC 12 at -O2 deletes a __builtin_prefetch it takes for
// an effect-free call (every caller of prefetch_bytes until 2026-11-22) or dead code under a test
// (the packed kernels' rewritten bf16 loop, 2026-12-01:
// bench/results/ragged_dot_packed_bf16-cpu-2026-12-01/prefetch-dce.cpp).
template <bool kL1 = true>
[[gnu::always_inline]] inline void prefetch_line(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  if constexpr (kL1) {
    asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
  } else {
    asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
  }
#else
  __builtin_prefetch(p, 0, kL1 ? 3 : 2);
#endif
}

// Asks for the cache lines of `bytes` at p (nullptr: nothing) ahead of their use, where the
// hardware prefetchers do not see the access pattern soon enough.
[[gnu::always_inline]] inline void prefetch_bytes(const void* p, size_t bytes) {
  if (!p) return;
  for (size_t b = 0; b < bytes; b += 64) prefetch_line(static_cast<const char*>(p) + b);
}

}  // namespace moekit::detail
