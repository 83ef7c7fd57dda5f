// XLA FFI handlers for the CPU kernels, and the nanobind module that hands them to Python as
// capsules (moekit/jax.py registers them with jax.ffi.register_ffi_target). Each handler turns
// the XLA buffers into moekit views, calls the C++ core, and returns its Status as an ffi::Error:
// the message names the argument and its value, and JAX raises it as a Python exception.
// Shapes and dtypes are checked in Python at trace time; the checks here catch what only the
// data can show (group sizes, offsets) and anything that slipped through.
#include "xla/ffi/api/ffi.h"

#include <nanobind/nanobind.h>

#include <cstdint>
#include <span>
#include <string>

#include "moekit/ragged_dot.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;

namespace moekit::python {
namespace {

ffi::Error to_error(const Status& s) {
  if (s.ok()) return ffi::Error::Success();
  return ffi::Error(s.code() == StatusCode::kInvalidArgument ? ffi::ErrorCode::kInvalidArgument
                                                             : ffi::ErrorCode::kInternal,
                    s.message());
}

// The moekit dtype of an XLA float buffer: f32 or bf16; false for any other type.
bool dtype_of(ffi::DataType t, DType* out) {
  if (t == ffi::DataType::F32) {
    *out = DType::kF32;
  } else if (t == ffi::DataType::BF16) {
    *out = DType::kBF16;
  } else {
    return false;
  }
  return true;
}

// A row-major view of an XLA buffer of rank <= kMaxRank (XLA's default layout is row-major).
template <class View, class Buffer>
ffi::Error view_of(const Buffer& b, const char* name, View* v) {
  DType t;
  if (!dtype_of(b.element_type(), &t)) {
    return ffi::Error::InvalidArgument(std::string(name) + ": dtype must be float32 or bfloat16");
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

// group_sizes [G] and group_offset (a scalar or [1]) of ragged_dot, both int32 in host memory.
ffi::Error group_args(ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::S32> offset,
                      std::span<const int32_t>* groups, RaggedDotOptions* o) {
  if (sizes.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("ragged_dot: group_sizes must have rank 1");
  }
  if (offset.element_count() != 1) {
    return ffi::Error::InvalidArgument("ragged_dot: group_offset must hold one value");
  }
  *groups = std::span<const int32_t>(sizes.typed_data(), sizes.element_count());
  o->group_offset = offset.typed_data()[0];
  return ffi::Error::Success();
}

#define MOEKIT_FFI_TRY(expr)                           \
  do {                                                 \
    ffi::Error moekit_error_ = (expr);                 \
    if (moekit_error_.failure()) return moekit_error_; \
  } while (0)

// The three ragged_dot calls take two float tensors, the groups and one result; `names` are
// the tensors' names in the errors.
using RaggedDotCall = Status (*)(ConstTensorView, ConstTensorView, std::span<const int32_t>,
                                 TensorView, const RaggedDotOptions&);
ffi::Error call_ragged(RaggedDotCall fn, const char* const (&names)[3], ffi::AnyBuffer a,
                       ffi::AnyBuffer b, ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::S32> offset,
                       ffi::AnyBuffer result) {
  ConstTensorView va, vb;
  TensorView out;
  std::span<const int32_t> groups;
  RaggedDotOptions opt;
  MOEKIT_FFI_TRY(view_of(a, names[0], &va));
  MOEKIT_FFI_TRY(view_of(b, names[1], &vb));
  MOEKIT_FFI_TRY(view_of(result, names[2], &out));
  MOEKIT_FFI_TRY(group_args(sizes, offset, &groups, &opt));
  return to_error(fn(va, vb, groups, out, opt));
}

// out [m, n] = ragged_dot(lhs [m, K], rhs [E_loc, K, n]) over the local groups.
ffi::Error ragged_dot_fwd(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> sizes,
                          ffi::Buffer<ffi::S32> offset, ffi::Result<ffi::AnyBuffer> out) {
  return call_ragged(ragged_dot, {"lhs", "rhs", "out"}, lhs, rhs, sizes, offset, *out);
}

// d_lhs [m, K] = ragged_dot(d_out [m, n], rhs^T).
ffi::Error ragged_dot_dlhs(ffi::AnyBuffer d_out, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> sizes,
                           ffi::Buffer<ffi::S32> offset, ffi::Result<ffi::AnyBuffer> d_lhs) {
  return call_ragged(moekit::ragged_dot_dlhs, {"d_out", "rhs", "d_lhs"}, d_out, rhs, sizes, offset,
                     *d_lhs);
}

// d_rhs [E_loc, K, n]: lhs[rows of j]^T @ d_out[rows of j] per local group.
ffi::Error ragged_dot_drhs(ffi::AnyBuffer lhs, ffi::AnyBuffer d_out, ffi::Buffer<ffi::S32> sizes,
                           ffi::Buffer<ffi::S32> offset, ffi::Result<ffi::AnyBuffer> d_rhs) {
  return call_ragged(moekit::ragged_dot_drhs, {"lhs", "d_out", "d_rhs"}, lhs, d_out, sizes, offset,
                     *d_rhs);
}

// The three ragged_dot calls share one binding: two float buffers, sizes, offset; one result.
auto ragged_binding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::AnyBuffer>();
}

XLA_FFI_DEFINE_HANDLER(kRaggedDotFwd, ragged_dot_fwd, ragged_binding());
XLA_FFI_DEFINE_HANDLER(kRaggedDotDlhs, ragged_dot_dlhs, ragged_binding());
XLA_FFI_DEFINE_HANDLER(kRaggedDotDrhs, ragged_dot_drhs, ragged_binding());

template <class Fn>
nb::capsule capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace
}  // namespace moekit::python

NB_MODULE(_moekit_ffi, m) {
  using namespace moekit::python;
  m.doc() = "XLA FFI handlers of the moekit CPU kernels (registered by moekit.jax)";
  m.def("registrations", [] {
    nb::dict d;
    d["moekit_ragged_dot_fwd"] = capsule(kRaggedDotFwd);
    d["moekit_ragged_dot_dlhs"] = capsule(kRaggedDotDlhs);
    d["moekit_ragged_dot_drhs"] = capsule(kRaggedDotDrhs);
    return d;
  });
  m.attr("BUILT_WITH_JAXLIB") = MOEKIT_JAXLIB_VERSION;  // whose FFI headers these handlers use
  m.attr("XLA_FFI_API_MAJOR") = XLA_FFI_API_MAJOR;
  m.attr("XLA_FFI_API_MINOR") = XLA_FFI_API_MINOR;
}
