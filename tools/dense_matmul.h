// A dense oneDNN matmul: the reference the grouped-matmul benches measure against.
#pragma once

#include <omp.h>

#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <vector>

#include "moekit/dtype.h"

namespace moekit::tools {

// A dense oneDNN matmul C[M, N] = A[M, Kc] @ B[Kc, N] with fixed dimensions and the given
// strides: the reference every ragged_dot pass is measured against. Where oneDNN has no bf16
// matmul (a CPU without AVX-512), bf16 operands are converted to f32 on every run and the f32
// matmul runs, as ragged_dot does there, so that the reference does the same work.
class DenseMatmul {
 public:
  DenseMatmul(DType in, DType out, int64_t M, int64_t Kc, int64_t N, dnnl::memory::dims a_strides,
              dnnl::memory::dims b_strides)
      : in_(in),
        out_(out),
        M_(M),
        Kc_(Kc),
        N_(N),
        a_strides_(a_strides),
        b_strides_(b_strides),
        a_({M, Kc}, dt(in), a_strides),
        b_({Kc, N}, dt(in), b_strides),
        c_({M, N}, dt(out), {N, 1}) {
    try {
      make(a_, b_, c_);
    } catch (const dnnl::error&) {
      if (in != DType::kBF16) throw;
      convert_ = true;
      a_ = {{M, Kc}, dnnl::memory::data_type::f32, {Kc, 1}};
      b_ = {{Kc, N}, dnnl::memory::data_type::f32, {N, 1}};
      c_ = {{M, N}, dnnl::memory::data_type::f32, {N, 1}};
      make(a_, b_, c_);
      impl_ += " (f32, bf16 converted: no bf16 matmul on this CPU)";
      fa_.resize(M * Kc), fb_.resize(Kc * N);
      if (out != DType::kF32) fc_.resize(M * N);
    }
  }
  void run(const void* a, const void* b, void* c) {
    if (convert_) {
      widen(static_cast<const bf16_bits*>(a), a_strides_, M_, Kc_, fa_.data());
      widen(static_cast<const bf16_bits*>(b), b_strides_, Kc_, N_, fb_.data());
      a = fa_.data(), b = fb_.data();
    }
    void* dst = convert_ && out_ != DType::kF32 ? fc_.data() : c;
    dnnl::memory ma(a_, engine_, const_cast<void*>(a)), mb(b_, engine_, const_cast<void*>(b)),
        mc(c_, engine_, dst);
    prim_.execute(stream_, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}});
    stream_.wait();
    if (dst != c) {
      auto* out = static_cast<bf16_bits*>(c);
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < M_ * N_; ++i) out[i] = float_to_bf16(fc_[i]);
    }
  }
  const std::string& impl() const { return impl_; }

 private:
  static dnnl::memory::data_type dt(DType t) {
    return t == DType::kF32 ? dnnl::memory::data_type::f32 : dnnl::memory::data_type::bf16;
  }
  void make(const dnnl::memory::desc& a, const dnnl::memory::desc& b, const dnnl::memory::desc& c) {
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), engine_);
    impl_ = pd.impl_info_str();
    prim_ = dnnl::matmul(pd);
  }
  // dst [rows, cols] row-major f32 = src [rows, cols] bf16 with strides s.
  static void widen(const bf16_bits* src, const dnnl::memory::dims& s, int64_t rows, int64_t cols,
                    float* dst) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < cols; ++j)
        dst[r * cols + j] = bf16_to_float(src[r * s[0] + j * s[1]]);
    }
  }
  DType in_, out_;
  int64_t M_, Kc_, N_;
  dnnl::memory::dims a_strides_, b_strides_;
  dnnl::engine engine_{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream_{engine_};
  dnnl::memory::desc a_, b_, c_;
  dnnl::matmul prim_;
  std::string impl_;
  bool convert_ = false;
  std::vector<float> fa_, fb_, fc_;
};

}  // namespace moekit::tools
