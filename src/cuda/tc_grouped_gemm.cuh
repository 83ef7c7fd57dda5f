// Internal (nvcc): what the two tensor-core implementations (sm80: CUTLASS 2.x, sm90: CUTLASS
// 3.x) share. Each is a family of kernels KernelT<TIn, TOut, LayoutA, LayoutB> computing
// D_j [M_j, N_j] (+)= A_j [M_j, K_j] @ B_j [K_j, N_j] over the local groups j, with D row-major
// and f32 accumulation, whose problem list the plan kernel writes on the device. A family member
// provides:
//   ElementA, ElementB, ElementD    CUTLASS element types
//   Arrays                          its per-group arguments in the workspace, with
//     __device__ set(j, m, n, k, a, lda, b, ldb, d, ldd)
//   arrays_in(workspace, E_loc)     where they are (workspace may be null: sizes only)
//   workspace_size(E_loc, info)
//   run(arrays, E_loc, accumulate, info, call, stream)
//   kOp                             the op name in its errors
// This file maps the two problems of ragged_dot_problem.h onto such a family.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/bfloat16.h>
#include <cutlass/cutlass.h>
#include <cutlass/half.h>
#include <cutlass/layout/matrix.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/grouped_gemm_cuda.h"
#include "cuda/plan.cuh"

namespace moekit::detail::cuda::tc {

// A CUTLASS step's outcome as a Status, with the CUDA error behind a failure when there is one.
inline Status cutlass_status(const char* op, const char* what, bool succeeded) {
  const cudaError_t e = cudaGetLastError();
  if (succeeded && e == cudaSuccess) return {};
  return Status::internal(
      op, std::string("CUTLASS ") + what + " failed" +
              (e != cudaSuccess ? std::string(": ") + cudaGetErrorString(e) : std::string()));
}

// Checks, initialises (its workspace, its kernel's shared-memory limit) and launches a CUTLASS
// grouped GEMM on `stream`. The arguments hold no group sizes, so every call launches the same.
template <class Gemm>
Status launch(const char* op, const typename Gemm::Arguments& args, void* workspace,
              cudaStream_t stream) {
  Gemm gemm;
  MOEKIT_RETURN_IF_ERROR(
      cutlass_status(op, "can_implement", gemm.can_implement(args) == cutlass::Status::kSuccess));
  MOEKIT_RETURN_IF_ERROR(cutlass_status(
      op, "initialize", gemm.initialize(args, workspace, stream) == cutlass::Status::kSuccess));
  return cutlass_status(op, "run", gemm.run(stream) == cutlass::Status::kSuccess);
}

// What the host knows of a call's tiles (the sm90 run order sizes its runs from it): the local
// groups' M extents add up to about m_total (row-grouped: the rows are ragged, and the local
// groups are taken to hold their share of all m rows) or are each m_each (contraction-grouped:
// p rows in every non-empty group), over `groups` local groups, each n wide.
struct CallShape {
  int64_t m_total = 0, m_each = 0, groups = 0, n = 0;
};
inline CallShape call_shape(const RowGroupedGemm& g, const Groups& groups) {
  // An estimate, so in floating point (no product of two sizes to overflow).
  const int64_t local_rows =
      groups.count > 0
          ? static_cast<int64_t>(static_cast<double>(g.m) * static_cast<double>(groups.num_local) /
                                 static_cast<double>(groups.count))
          : 0;
  return {local_rows, 0, groups.num_local, g.n};
}
inline CallShape call_shape(const ContractionGroupedGemm& g, const Groups& groups) {
  return {0, g.p, groups.num_local, g.q};
}

// Row-grouped (forward, input gradient): local group j is D = C[rows of j], A = the input's same
// rows (row-major), B = rhs[j] (either layout).
template <class K>
struct RowEmit {
  typename K::Arrays w;
  const typename K::ElementA* a;
  int64_t lda;
  const typename K::ElementB* b;
  int64_t b_batch, ldb;
  typename K::ElementD* c;
  int64_t ldc;
  int n, kc;
  __device__ void operator()(int64_t j, int64_t begin, int64_t rows) const {
    w.set(j, static_cast<int>(rows), n, kc, a + begin * lda, lda, b + j * b_batch, ldb,
          c + begin * ldc, ldc);
  }
};

// Contraction-grouped (weight gradient): local group j is D = C_j [p, q], A = X[rows of j]^T
// (column-major, p x rows), B = Y[rows of j] (row-major, rows x q). An empty group gets no tiles
// (M = 0): zero_uncovered has written its zeros.
template <class K>
struct ContractionEmit {
  typename K::Arrays w;
  const typename K::ElementA* x;
  int64_t ldx;
  const typename K::ElementB* y;
  int64_t ldy;
  typename K::ElementD* c;
  int64_t c_batch, ldc;
  int p, q;
  __device__ void operator()(int64_t j, int64_t begin, int64_t rows) const {
    w.set(j, rows > 0 ? p : 0, q, static_cast<int>(rows), x + begin * ldx, ldx, y + begin * ldy,
          ldy, c + j * c_batch, ldc);
  }
};

// Plan, zeros and the grouped GEMM of kernel K, with the emitter make_emit(arrays) builds.
template <class K, class Problem, class MakeEmit>
Status run(const Problem& g, const Groups& groups, const Exec& exec, const DeviceInfo& info,
           MakeEmit make_emit) {
  MOEKIT_RETURN_IF_ERROR(check_workspace(K::kOp, exec, K::workspace_size(groups.num_local, info)));
  const typename K::Arrays w = K::arrays_in(exec.workspace, groups.num_local);
  MOEKIT_RETURN_IF_ERROR(
      plan_and_zero(K::kOp, g, groups, exec.workspace, make_emit(w), exec.stream));
  if (groups.num_local == 0) return {};
  return K::run(w, groups.num_local, g.accumulate, info, call_shape(g, groups), exec.stream);
}

template <template <class, class, class, class> class KernelT, class TIn, class TOut, class LayoutB>
Status row_grouped_as(const RowGroupedGemm& g, const Groups& groups, const Exec& exec,
                      const DeviceInfo& info, int64_t ldb) {
  using K = KernelT<TIn, TOut, cutlass::layout::RowMajor, LayoutB>;
  return run<K>(g, groups, exec, info, [&](const typename K::Arrays& w) {
    return RowEmit<K>{w,
                      static_cast<const TIn*>(g.a),
                      g.lda,
                      static_cast<const TIn*>(g.b),
                      g.b_batch,
                      ldb,
                      static_cast<TOut*>(g.c),
                      g.ldc,
                      static_cast<int>(g.n),
                      static_cast<int>(g.kc)};
  });
}

template <template <class, class, class, class> class KernelT, class TIn, class TOut>
Status contraction_grouped_as(const ContractionGroupedGemm& g, const Groups& groups,
                              const Exec& exec, const DeviceInfo& info) {
  using K = KernelT<TIn, TOut, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  return run<K>(g, groups, exec, info, [&](const typename K::Arrays& w) {
    return ContractionEmit<K>{w,
                              static_cast<const TIn*>(g.x),
                              g.ldx,
                              static_cast<const TIn*>(g.y),
                              g.ldy,
                              static_cast<TOut*>(g.c),
                              g.c_batch,
                              g.ldc,
                              static_cast<int>(g.p),
                              static_cast<int>(g.q)};
  });
}

// The entry points of one family and input dtype (CUTLASS's bfloat16_t or half_t); the output
// dtype and the layout of rhs pick the kernel.
template <template <class, class, class, class> class KernelT, class TIn>
Status row_grouped(const RowGroupedGemm& g, const Groups& groups, const Exec& exec,
                   const DeviceInfo& info) {
  using cutlass::layout::ColumnMajor;
  using cutlass::layout::RowMajor;
  // B = rhs[j] as K x N: row-major when its columns are contiguous, else column-major.
  const bool b_row_major = g.b_s1 == 1;
  const int64_t ldb = b_row_major ? g.b_s0 : g.b_s1;
  if (g.out_type == DType::kF32) {
    return b_row_major
               ? row_grouped_as<KernelT, TIn, float, RowMajor>(g, groups, exec, info, ldb)
               : row_grouped_as<KernelT, TIn, float, ColumnMajor>(g, groups, exec, info, ldb);
  }
  return b_row_major ? row_grouped_as<KernelT, TIn, TIn, RowMajor>(g, groups, exec, info, ldb)
                     : row_grouped_as<KernelT, TIn, TIn, ColumnMajor>(g, groups, exec, info, ldb);
}

template <template <class, class, class, class> class KernelT, class TIn>
Status contraction_grouped(const ContractionGroupedGemm& g, const Groups& groups, const Exec& exec,
                           const DeviceInfo& info) {
  if (g.out_type == DType::kF32) {
    return contraction_grouped_as<KernelT, TIn, float>(g, groups, exec, info);
  }
  return contraction_grouped_as<KernelT, TIn, TIn>(g, groups, exec, info);
}

// The largest workspace any kernel of the family and input dtype needs.
template <template <class, class, class, class> class KernelT, class TIn>
size_t workspace_size(int64_t num_local, const DeviceInfo& info) {
  using cutlass::layout::ColumnMajor;
  using cutlass::layout::RowMajor;
  return std::max({KernelT<TIn, float, RowMajor, RowMajor>::workspace_size(num_local, info),
                   KernelT<TIn, float, RowMajor, ColumnMajor>::workspace_size(num_local, info),
                   KernelT<TIn, float, ColumnMajor, RowMajor>::workspace_size(num_local, info),
                   KernelT<TIn, TIn, RowMajor, RowMajor>::workspace_size(num_local, info),
                   KernelT<TIn, TIn, RowMajor, ColumnMajor>::workspace_size(num_local, info),
                   KernelT<TIn, TIn, ColumnMajor, RowMajor>::workspace_size(num_local, info)});
}

// Explicit instantiation (in the family's per-dtype file) and its extern declaration (in the
// file of the family's entry points), so that each dtype compiles in a file of its own. Used
// inside namespace moekit::detail::cuda::tc.
#define MOEKIT_TC_TEMPLATES(prefix, KernelT, TIn)                                        \
  prefix template Status row_grouped<KernelT, TIn>(const RowGroupedGemm&, const Groups&, \
                                                   const Exec&, const DeviceInfo&);      \
  prefix template Status contraction_grouped<KernelT, TIn>(                              \
      const ContractionGroupedGemm&, const Groups&, const Exec&, const DeviceInfo&);     \
  prefix template size_t workspace_size<KernelT, TIn>(int64_t, const DeviceInfo&);
#define MOEKIT_TC_INSTANTIATE(KernelT, TIn) MOEKIT_TC_TEMPLATES(, KernelT, TIn)
#define MOEKIT_TC_EXTERN(KernelT, TIn) MOEKIT_TC_TEMPLATES(extern, KernelT, TIn)

// The entry points of grouped_gemm_cuda.h for one family: dispatch on the input dtype.
template <template <class, class, class, class> class KernelT>
size_t workspace_size_any(int64_t num_local, const DeviceInfo& info) {
  return std::max(workspace_size<KernelT, cutlass::bfloat16_t>(num_local, info),
                  workspace_size<KernelT, cutlass::half_t>(num_local, info));
}

template <template <class, class, class, class> class KernelT>
Status row_grouped_any(const RowGroupedGemm& g, const Groups& groups, const Exec& exec,
                       const DeviceInfo& info) {
  if (g.in_type == DType::kBF16) {
    return row_grouped<KernelT, cutlass::bfloat16_t>(g, groups, exec, info);
  }
  if (g.in_type == DType::kF16) return row_grouped<KernelT, cutlass::half_t>(g, groups, exec, info);
  return Status::unimplemented("ragged_dot (CUDA)", "tensor-core inputs must be bf16 or f16");
}

template <template <class, class, class, class> class KernelT>
Status contraction_grouped_any(const ContractionGroupedGemm& g, const Groups& groups,
                               const Exec& exec, const DeviceInfo& info) {
  if (g.in_type == DType::kBF16) {
    return contraction_grouped<KernelT, cutlass::bfloat16_t>(g, groups, exec, info);
  }
  if (g.in_type == DType::kF16) {
    return contraction_grouped<KernelT, cutlass::half_t>(g, groups, exec, info);
  }
  return Status::unimplemented("ragged_dot (CUDA)", "tensor-core inputs must be bf16 or f16");
}

}  // namespace moekit::detail::cuda::tc
