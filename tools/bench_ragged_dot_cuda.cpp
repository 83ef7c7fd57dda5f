// moekit bench ragged_dot --device cuda: the three passes on the GPU, each beside a cuBLAS
// matmul of all m rows with the same FLOPs and operand layouts, and one shard's call beside the
// full call; every run timed with a pair of CUDA events on one stream, runs alternating
// (bench_device_cuda.cpp).
#include <fmt/format.h>

#include <functional>
#include <span>
#include <string>
#include <vector>

#include "bench_device.h"
#include "bench_ragged_dot.h"
#include "moekit/ragged_dot.h"

namespace moekit::tools {

std::string time_ragged_dot_cuda(const RaggedDotBenchOptions& o, const Preset& p, DType in,
                                 DType out, int shard, std::FILE* text, Progress& progress,
                                 std::vector<RaggedDotRow>& rows) {
  const std::unique_ptr<BenchDevice> dev = make_cuda_bench_device();
  const size_t in_es = dtype_size(in), out_es = dtype_size(out);

  for (int64_t T : o.tokens) {
    const RaggedDotProblem pr = ragged_dot_problem(p, T, in, out, o, text);
    const int64_t m = pr.m, E = pr.E, K = pr.K, n = pr.n;
    Mem lhs = dev->alloc(m * K * in_es), rhs = dev->alloc(E * K * n * in_es),
        d_out = dev->alloc(m * n * in_es);
    Mem y = dev->alloc(m * n * out_es), d_lhs = dev->alloc(m * K * out_es),
        d_rhs = dev->alloc(E * K * n * out_es);
    dev->fill(lhs.data(), in, m * K, o.seed + 1);
    dev->fill(rhs.data(), in, E * K * n, o.seed + 2);
    dev->fill(d_out.data(), in, m * n, o.seed + 3);
    Mem sizes = dev->alloc(pr.sizes.size() * sizeof(int32_t));
    dev->upload(sizes.data(), pr.sizes.data(), pr.sizes.size() * sizeof(int32_t));
    const Exec exec = dev->exec(dev->alloc(ragged_dot_workspace_size(Device::kCuda, E)));
    const std::span<const int32_t> device_sizes(static_cast<const int32_t*>(sizes.data()),
                                                pr.sizes.size());
    const ConstTensorView lhs_v(lhs.data(), in, {m, K}), d_out_v(d_out.data(), in, {m, n});
    const TensorView y_v(y.data(), out, {m, n}), d_lhs_v(d_lhs.data(), out, {m, K});

    for (const std::string pass : {"fwd", "dlhs", "drhs"}) {
      auto call = [&](int64_t e_loc, int32_t offset, const RaggedDotOptions& opt) {
        const RaggedDotGroups groups{device_sizes, offset};
        const ConstTensorView w(rhs.data(), in, {e_loc, K, n});
        if (pass == "fwd") return ragged_dot(lhs_v, w, groups, y_v, opt, exec);
        if (pass == "dlhs") return ragged_dot_dlhs(d_out_v, w, groups, d_lhs_v, opt, exec);
        return ragged_dot_drhs(lhs_v, d_out_v, groups, TensorView(d_rhs.data(), out, {e_loc, K, n}),
                               opt, exec);
      };
      // The dense matmul of all m rows with the pass's operand layouts (one weight matrix).
      std::unique_ptr<DenseRef> dense = dev->dense(in, out, m, K, n);
      const void *da = lhs.data(), *db = rhs.data();
      void* dc = y.data();
      if (pass == "dlhs") {  // [m, n] @ rhs[0]^T, rhs[0] stored [K, n]
        dense = dev->dense(in, out, m, n, K, false, true);
        da = d_out.data(), dc = d_lhs.data();
      } else if (pass == "drhs") {  // lhs^T [K, m] @ d_out [m, n], lhs stored [m, K]
        dense = dev->dense(in, out, K, m, n, true, false);
        db = d_out.data(), dc = d_rhs.data();
      }
      time_pass(
          o, pr, shard, full_row(pass, pr, dense->impl()), call, [&] { dense->run(da, db, dc); },
          [&](const auto& fns) { return dev->time(o.warmup, o.reps, fns); },
          fmt::format("{} T={} {}: ragged_dot, cuBLAS", p.name, T, pass), progress, rows);
    }
  }
  return dev->description();
}

}  // namespace moekit::tools
