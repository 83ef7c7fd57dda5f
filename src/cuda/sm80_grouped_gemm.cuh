// Internal (nvcc, sm_80): CUTLASS 2.x grouped GEMM, the tensor-core path for Ampere and later
// devices that are not Hopper. Multistage cp.async mainloop with mma.sync, 128x128x32 tiles;
// the problem visitor walks the per-group problem list that the plan kernel writes on the
// device (GroupScheduleMode::kDeviceOnly), over a grid of one full wave whatever the group
// sizes. The kernel family of tc_grouped_gemm.cuh; instantiated per input dtype in
// sm80_grouped_gemm_<dtype>.cu.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/gemm/device/gemm_grouped.h>
#include <cutlass/gemm/gemm.h>
#include <cutlass/gemm/kernel/default_gemm_grouped.h>
#include <cutlass/gemm/threadblock/threadblock_swizzle.h>

#include <array>
#include <atomic>
#include <cstdint>

#include "cuda/grouped_gemm_cuda.h"
#include "cuda/plan.cuh"
#include "cuda/tc_grouped_gemm.cuh"

namespace moekit::detail::cuda::sm80 {

template <class TIn, class TOut, class LayoutA, class LayoutB>
struct Kernel {
  static constexpr int kAlignIn = 16 / sizeof(TIn);
  static constexpr int kAlignOut = 16 / sizeof(TOut);
  using Epilogue = cutlass::epilogue::thread::LinearCombination<TOut, kAlignOut, float, float>;
  using GemmKernel = typename cutlass::gemm::kernel::DefaultGemmGrouped<
      TIn, LayoutA, cutlass::ComplexTransform::kNone, kAlignIn, TIn, LayoutB,
      cutlass::ComplexTransform::kNone, kAlignIn, TOut, cutlass::layout::RowMajor, float,
      cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80, cutlass::gemm::GemmShape<128, 128, 32>,
      cutlass::gemm::GemmShape<64, 64, 32>, cutlass::gemm::GemmShape<16, 8, 16>, Epilogue,
      // Grouped kernels ignore the swizzle; the parameter is only there to match the others.
      cutlass::gemm::threadblock::GemmBatchedIdentityThreadblockSwizzle, /*Stages=*/4,
      cutlass::gemm::kernel::GroupScheduleMode::kDeviceOnly>::GemmKernel;
  using Gemm = cutlass::gemm::device::GemmGrouped<GemmKernel>;
  using ElementA = TIn;
  using ElementB = TIn;
  using ElementD = TOut;
  static constexpr const char* kOp = "ragged_dot (CUDA, sm80)";

  // The per-group arrays in the workspace, after the plan (GemmGrouped needs no workspace of
  // its own when it schedules on the device).
  struct Arrays {
    cutlass::gemm::GemmCoord* shapes;
    ElementA** a;
    ElementB** b;
    ElementD** c;
    ElementD** d;
    int64_t *lda, *ldb, *ldc, *ldd;
    uintptr_t end;

    __device__ void set(int64_t j, int m, int n, int k, const ElementA* a, int64_t lda,
                        const ElementB* b, int64_t ldb, ElementD* d, int64_t ldd) const {
      shapes[j] = cutlass::gemm::GemmCoord(m, n, k);
      this->a[j] = const_cast<ElementA*>(a);
      this->b[j] = const_cast<ElementB*>(b);
      c[j] = d;
      this->d[j] = d;
      this->lda[j] = lda;
      this->ldb[j] = ldb;
      this->ldc[j] = ldd;
      this->ldd[j] = ldd;
    }
  };

  static Arrays arrays_in(void* workspace, int64_t num_local) {
    WorkspaceCursor cursor(workspace, num_local);
    Arrays r;
    r.shapes = cursor.take<cutlass::gemm::GemmCoord>(num_local);
    r.a = cursor.take<ElementA*>(num_local);
    r.b = cursor.take<ElementB*>(num_local);
    r.c = cursor.take<ElementD*>(num_local);
    r.d = cursor.take<ElementD*>(num_local);
    r.lda = cursor.take<int64_t>(num_local);
    r.ldb = cursor.take<int64_t>(num_local);
    r.ldc = cursor.take<int64_t>(num_local);
    r.ldd = cursor.take<int64_t>(num_local);
    r.end = cursor.position();
    return r;
  }

  static typename Gemm::Arguments arguments(const Arrays& w, int64_t num_local, bool accumulate,
                                            int threadblocks) {
    // beta = 0: C is never read.
    typename Epilogue::Params epilogue(1.0f, accumulate ? 1.0f : 0.0f);
    return typename Gemm::Arguments(w.shapes, static_cast<int>(num_local), threadblocks, epilogue,
                                    w.a, w.b, w.c, w.d, w.lda, w.ldb, w.ldc, w.ldd,
                                    /*host_problem_sizes=*/nullptr);
  }

  static size_t workspace_size(int64_t num_local, const DeviceInfo&) {
    const Arrays w = arrays_in(nullptr, num_local);
    return w.end + align_up(Gemm::get_workspace_size(arguments(w, num_local, false, 1)));
  }

  // One full wave (multiprocessors x resident blocks), the same on every call: read once per
  // device, since the occupancy query also sets the kernel's attributes.
  static int threadblocks(const DeviceInfo& info) {
    static std::array<std::atomic<int>, kMaxCachedDevices> cache{};
    const bool cached = info.device >= 0 && info.device < kMaxCachedDevices;
    int blocks = cached ? cache[info.device].load(std::memory_order_relaxed) : 0;
    if (blocks <= 0) {
      blocks = Gemm::sufficient(nullptr, 0, info.sm_count);
      if (cached && blocks > 0) cache[info.device].store(blocks, std::memory_order_relaxed);
    }
    return blocks;
  }

  static Status run(const Arrays& w, int64_t num_local, bool accumulate, const DeviceInfo& info,
                    const tc::CallShape&, cudaStream_t stream) {
    const int blocks = threadblocks(info);
    MOEKIT_RETURN_IF_ERROR(tc::cutlass_status(kOp, "occupancy query", blocks > 0));
    return tc::launch<Gemm>(kOp, arguments(w, num_local, accumulate, blocks),
                            reinterpret_cast<void*>(w.end), stream);
  }
};

}  // namespace moekit::detail::cuda::sm80
