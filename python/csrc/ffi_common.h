// What the CPU handlers (ffi.cpp) and the CUDA handlers (ffi_cuda.cpp) share: a moekit Status as
// an ffi::Error, an XLA buffer as a moekit view (the data pointer is the host's or the device's,
// the shape is the same), and the table of handlers the library exports to Python.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include "moekit/ragged_dot.h"
#include "moekit/status.h"
#include "moekit/view.h"
#include "xla/ffi/api/ffi.h"

namespace moekit::python {

namespace ffi = xla::ffi;

// One handler for one platform, as moekit/jax/_ffi.py registers it with
// jax.ffi.register_ffi_target(name, handler, platform).
struct Target {
  const char* name;
  const char* platform;  // "cpu" or "CUDA"
  XLA_FFI_Handler* handler;
};

// The CUDA handlers (ffi_cuda.cpp); empty in a build without CUDA.
std::span<const Target> cuda_targets();

// The CUDA handlers take their workspace as a result buffer. XLA aligns buffers less than the
// kernels need, so that result holds kCudaWorkspaceAlign - 1 bytes more than the op's
// *_workspace_size(Device::kCuda, ...), and a handler starts at its first aligned byte.
inline constexpr size_t kCudaWorkspaceAlign = 256;

inline ffi::Error to_error(const Status& s) {
  if (s.ok()) return ffi::Error::Success();
  return ffi::Error(s.code() == StatusCode::kInvalidArgument ? ffi::ErrorCode::kInvalidArgument
                                                             : ffi::ErrorCode::kInternal,
                    s.message());
}

// The moekit dtype of an XLA buffer: f32, bf16, f16, i32 or bool; false for any other type.
// Which of them an argument may have is the C++ call's to check (its errors name the argument).
inline bool dtype_of(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F32:
      *out = DType::kF32;
      return true;
    case ffi::DataType::BF16:
      *out = DType::kBF16;
      return true;
    case ffi::DataType::F16:
      *out = DType::kF16;
      return true;
    case ffi::DataType::S32:
      *out = DType::kI32;
      return true;
    case ffi::DataType::PRED:
      *out = DType::kBool;
      return true;
    default:
      return false;
  }
}

// A row-major view of an XLA buffer of rank <= kMaxRank (XLA's default layout is row-major).
// present = false: the absent (default) view, for an optional argument passed as a placeholder.
template <class View, class Buffer>
ffi::Error view_of(const Buffer& b, const char* name, View* v, bool present = true) {
  if (!present) {
    *v = View();
    return ffi::Error::Success();
  }
  DType t;
  if (!dtype_of(b.element_type(), &t)) {
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": dtype must be float32, bfloat16, float16, int32 or bool");
  }
  const auto dims = b.dimensions();
  if (dims.size() > static_cast<size_t>(kMaxRank)) {
    return ffi::Error::InvalidArgument(std::string(name) + ": rank above 4");
  }
  View out;
  out.data = b.untyped_data();
  out.dtype = t;
  out.rank = static_cast<int>(dims.size());
  int64_t stride = 1;
  for (int d = out.rank - 1; d >= 0; --d) {
    out.shape[d] = dims[d];
    out.stride[d] = stride;
    stride *= dims[d];
  }
  *v = out;
  return ffi::Error::Success();
}

// group_sizes must have rank 1 and group_offset (a scalar or [1]) one value, wherever they live.
inline ffi::Error check_group_buffers(ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::S32> offset) {
  if (sizes.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("ragged_dot: group_sizes must have rank 1");
  }
  if (offset.element_count() != 1) {
    return ffi::Error::InvalidArgument("ragged_dot: group_offset must hold one value");
  }
  return ffi::Error::Success();
}

// The three ragged_dot calls take two float tensors, group_sizes, group_offset and one result;
// `bind` is where the binding starts (the CUDA handlers first ask for the stream).
template <class Binding>
auto ragged_binding(Binding&& bind) {
  return std::forward<Binding>(bind)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::AnyBuffer>();
}

// The attributes every ragged_dot handler takes last, in the order XLA passes them (by name).
template <class Binding>
auto ragged_attrs(Binding&& bind) {
  return std::forward<Binding>(bind)
      .template Attr<bool>("batch_invariant")
      .template Attr<bool>("rhs_transposed");
}

// Rows [from, N) of an [N, ...] buffer set to 0: what a handler leaves of a result whose static
// shape is a worst case past the rows it computed.
inline void zero_rows_from(ffi::AnyBuffer b, int64_t from) {
  const auto dims = b.dimensions();
  if (dims.size() == 0 || from >= dims[0]) return;
  const size_t row_bytes = b.size_bytes() / static_cast<size_t>(dims[0]);
  std::memset(static_cast<std::byte*>(b.untyped_data()) + static_cast<size_t>(from) * row_bytes, 0,
              static_cast<size_t>(dims[0] - from) * row_bytes);
}

#define MOEKIT_FFI_TRY(expr)                           \
  do {                                                 \
    ffi::Error moekit_error_ = (expr);                 \
    if (moekit_error_.failure()) return moekit_error_; \
  } while (0)

// The three calls of ragged_dot.h, as the handlers take them.
using RaggedDotCall = Status (*)(ConstTensorView, ConstTensorView, const RaggedDotGroups&,
                                 TensorView, const RaggedDotOptions&, const Exec&);

// The handlers' attributes, as RaggedDotOptions takes them: the mode, and whether the weights
// (rhs, or the weight gradient) are stored [E_loc, n, K].
struct RaggedDotAttrs {
  bool batch_invariant = false;
  bool rhs_transposed = false;
  bool rhs_packed = false;  // the forward on pack_ragged_rhs's layout (CPU, bf16)
};

// One ragged_dot call from its XLA buffers: the float tensors a, b and the result (`names` name
// them in the errors), group_sizes and group_offset, and the attributes. The CPU reads the offset
// on the host; on CUDA it stays on the device, with the sizes.
inline ffi::Error call_ragged(RaggedDotCall fn, const char* const (&names)[3], ffi::AnyBuffer a,
                              ffi::AnyBuffer b, ffi::Buffer<ffi::S32> sizes,
                              ffi::Buffer<ffi::S32> offset, ffi::AnyBuffer result,
                              RaggedDotAttrs attrs, const Exec& exec = {}) {
  ConstTensorView va, vb;
  TensorView out;
  MOEKIT_FFI_TRY(view_of(a, names[0], &va));
  MOEKIT_FFI_TRY(view_of(b, names[1], &vb));
  MOEKIT_FFI_TRY(view_of(result, names[2], &out));
  MOEKIT_FFI_TRY(check_group_buffers(sizes, offset));
  RaggedDotGroups groups(std::span<const int32_t>(sizes.typed_data(), sizes.element_count()));
  if (exec.device == Device::kCuda) {
    groups.device_offset = offset.typed_data();
  } else {
    groups.offset = offset.typed_data()[0];
  }
  RaggedDotOptions options;
  options.batch_invariant = attrs.batch_invariant;
  options.rhs_transposed = attrs.rhs_transposed;
  options.rhs_packed = attrs.rhs_packed;
  return to_error(fn(va, vb, groups, out, options, exec));
}

}  // namespace moekit::python
