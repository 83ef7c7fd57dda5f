// A dense oneDNN matmul: the reference the grouped-matmul benches measure against.
#pragma once

#include <oneapi/dnnl/dnnl.hpp>
#include <string>

#include "moekit/dtype.h"

namespace moekit::tools {

// A dense oneDNN matmul C[M, N] = A[M, Kc] @ B[Kc, N] with fixed dimensions and the given
// strides: the reference every ragged_dot pass is measured against.
class DenseMatmul {
 public:
  DenseMatmul(DType in, DType out, int64_t M, int64_t Kc, int64_t N, dnnl::memory::dims a_strides,
              dnnl::memory::dims b_strides)
      : a_({M, Kc}, dt(in), a_strides),
        b_({Kc, N}, dt(in), b_strides),
        c_({M, N}, dt(out), {N, 1}) {
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_, b_, c_), engine_);
    impl_ = pd.impl_info_str();
    prim_ = dnnl::matmul(pd);
  }
  void run(const void* a, const void* b, void* c) {
    dnnl::memory ma(a_, engine_, const_cast<void*>(a)), mb(b_, engine_, const_cast<void*>(b)),
        mc(c_, engine_, c);
    prim_.execute(stream_, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}});
    stream_.wait();
  }
  const std::string& impl() const { return impl_; }

 private:
  static dnnl::memory::data_type dt(DType t) {
    return t == DType::kF32 ? dnnl::memory::data_type::f32 : dnnl::memory::data_type::bf16;
  }
  dnnl::engine engine_{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream_{engine_};
  dnnl::memory::desc a_, b_, c_;
  dnnl::matmul prim_;
  std::string impl_;
};

}  // namespace moekit::tools
