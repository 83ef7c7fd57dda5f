// stream_bytes and stream_fence (stream.h): the non-temporal copy, written once with Highway and
// compiled for every x86 target it knows; the widest the CPU supports is picked at run time.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/stream.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Must come after foreach_target.h.
#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/stream.h"

HWY_BEFORE_NAMESPACE();
namespace moekit::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Non-temporal copy of the whole aligned vectors of dst, so that a large output does not first
// read every line it overwrites; plain copies for the unaligned ends.
void StreamBytes(void* dst, const void* src, size_t bytes) {
  const hn::ScalableTag<float> d;
  const size_t vector_bytes = hn::Lanes(d) * sizeof(float);
  auto* out = static_cast<char*>(dst);
  const auto* in = static_cast<const char*>(src);
  // Plain copies for the bytes before the first aligned vector and after the last whole one.
  const size_t head = std::min(
      bytes, (vector_bytes - reinterpret_cast<uintptr_t>(out) % vector_bytes) % vector_bytes);
  const size_t body = (bytes - head) / vector_bytes * vector_bytes;
  std::memcpy(out, in, head);
  for (size_t i = head; i < head + body; i += vector_bytes) {
    hn::Stream(hn::LoadU(d, reinterpret_cast<const float*>(in + i)), d,
               reinterpret_cast<float*>(out + i));
  }
  std::memcpy(out + head + body, in + head + body, bytes - head - body);
}

}  // namespace moekit::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moekit::detail {

HWY_EXPORT(StreamBytes);

void stream_bytes(void* dst, const void* src, size_t bytes) {
  HWY_DYNAMIC_DISPATCH(StreamBytes)(dst, src, bytes);
}
void stream_fence() { hwy::FlushStream(); }

}  // namespace moekit::detail
#endif  // HWY_ONCE
