// ragged_dot.h on CUDA buffers against the CPU scalar reference of the same calls.
//
// Without a GPU (or built without CUDA) the tests that need one skip with a message; the rules
// for device-resident sizes (cuda/plan_math.h) and the host-side argument checks run anyway.
//
// Inputs are multiples of 1/64 in [-1, 1]: exact in bf16 and f16, with exact products, and with
// every partial sum exact in f32 while sums stay under 4096 in magnitude (every shape here). So
// the GPU result must equal the reference bit for bit, whatever order either sums in; a bf16 or
// f16 output is the exact f32 result rounded once to nearest even.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/grouped_gemm_cuda.h"
#include "cuda/plan_math.h"
#include "cuda/tile_runs.h"
#include "host_tensor.h"
#include "moekit/ragged_dot.h"

#if MOEKIT_HAS_CUDA
#include "device_tensor.h"
#endif

namespace moekit {

// gtest prints an implementation by its name (ADL finds it here, beside the enum).
inline void PrintTo(RaggedDotImpl impl, std::ostream* os) { *os << impl_name(impl); }

namespace {

// --- The device-side rules, on the host -------------------------------------------------------

TEST(CudaPlanRules, NegativeSizesCountAsZero) {
  EXPECT_EQ(detail::cuda::clamp_group_size(-5), 0);
  EXPECT_EQ(detail::cuda::clamp_group_size(std::numeric_limits<int32_t>::min()), 0);
  EXPECT_EQ(detail::cuda::clamp_group_size(7), 7);
}

TEST(CudaPlanRules, OffsetIsClampedIntoRange) {
  EXPECT_EQ(detail::cuda::clamp_group_offset(-1, 8, 2), 0);
  EXPECT_EQ(detail::cuda::clamp_group_offset(3, 8, 2), 3);
  EXPECT_EQ(detail::cuda::clamp_group_offset(6, 8, 2), 6);
  EXPECT_EQ(detail::cuda::clamp_group_offset(7, 8, 2), 6);
  EXPECT_EQ(detail::cuda::clamp_group_offset(1 << 30, 8, 8), 0);
}

TEST(CudaPlanRules, RowsAreClippedToM) {
  auto r = detail::cuda::clip_rows(10, 5, 100);
  EXPECT_EQ(r.begin, 10);
  EXPECT_EQ(r.end, 15);
  r = detail::cuda::clip_rows(98, 5, 100);
  EXPECT_EQ(r.begin, 98);
  EXPECT_EQ(r.end, 100);
  r = detail::cuda::clip_rows(int64_t{1} << 40, 5, 100);
  EXPECT_EQ(r.begin, 100);
  EXPECT_EQ(r.end, 100);
}

// kAuto's sm90 schedule for the forward and input gradient, at each edge of the rule: m rows over
// `groups` groups, `local` of them on this shard, contraction kc, output width n, B row-major (the
// forward) or not (the input gradient); on an H100's memory bandwidth per SM and an H200's.
TEST(CudaScheduleRules, RowSchedulesByShapeAndCard) {
  using detail::cuda::Sm90RowShape;
  const auto rule = detail::cuda::sm90_row_schedule;
  const bool h100 = false, h200 = true;
  constexpr RaggedDotImpl pp = RaggedDotImpl::kCudaSm90Pingpong,
                          pp64 = RaggedDotImpl::kCudaSm90Pingpong64x256,
                          coop256 = RaggedDotImpl::kCudaSm90Cooperative256;
  const auto fwd = [](int64_t m, int64_t groups, int64_t local, int64_t kc, int64_t n) {
    return Sm90RowShape{m, groups, local, kc, n, true};
  };
  const auto dlhs = [](int64_t m, int64_t groups, int64_t local, int64_t kc, int64_t n) {
    return Sm90RowShape{m, groups, local, kc, n, false};
  };
  // H100: long groups with rows enough (1024 rows per group expected, 16384 local rows), either
  // layout; never 64x256 (not measured there).
  EXPECT_EQ(rule(fwd(131072, 128, 128, 2048, 768), h100), coop256);  // qwen3-30b-a3b, 16384 tokens
  EXPECT_EQ(rule(dlhs(131072, 128, 128, 768, 2048), h100), coop256);
  EXPECT_EQ(rule(fwd(130944, 128, 128, 2048, 768), h100), pp);  // 1023 rows per group
  EXPECT_EQ(rule(fwd(16384, 16, 16, 2048, 768), h100), coop256);
  EXPECT_EQ(rule(fwd(8192, 8, 8, 4096, 14336), h100), pp);          // mixtral-8x7b, 4096 tokens
  EXPECT_EQ(rule(fwd(131072, 128, 16, 2048, 768), h100), coop256);  // a shard of 16 groups
  EXPECT_EQ(rule(fwd(131072, 128, 15, 2048, 768), h100), pp);       // of 15: 15360 rows
  EXPECT_EQ(rule(fwd(4096, 128, 128, 2048, 768), h100), pp);        // 32 rows a group
  // H100: a long contraction to few columns, from 256 rows per group.
  EXPECT_EQ(rule(fwd(65536, 256, 64, 7168, 2048), h100), coop256);  // deepseek-v3, 8192 tokens
  EXPECT_EQ(rule(fwd(65280, 256, 64, 7168, 2048), h100), pp);
  EXPECT_EQ(rule(fwd(65536, 256, 64, 7167, 2048), h100), pp);
  EXPECT_EQ(rule(fwd(65536, 256, 64, 7168, 2056), h100), pp);
  EXPECT_EQ(rule(dlhs(65536, 256, 64, 2048, 7168), h100), pp);  // its input gradient
  // H200, either layout: 64x256 up to 256 rows a group on any width, up to 1024 on a width that
  // is a multiple of 256.
  EXPECT_EQ(rule(fwd(16384, 64, 64, 2048, 1408), h200), pp64);    // deepseek-v2-lite, 256 rows
  EXPECT_EQ(rule(fwd(16448, 64, 64, 2048, 1408), h200), pp);      // 257
  EXPECT_EQ(rule(dlhs(8192, 32, 32, 2880, 2880), h200), pp64);    // gpt-oss-20b, 256
  EXPECT_EQ(rule(dlhs(16384, 32, 32, 2880, 2880), h200), pp);     // 512
  EXPECT_EQ(rule(fwd(131072, 128, 128, 2048, 768), h200), pp64);  // qwen3, 1024 rows a group
  EXPECT_EQ(rule(dlhs(131072, 128, 128, 768, 2048), h200), pp64);
  EXPECT_EQ(rule(fwd(131200, 128, 128, 2048, 768), h200), coop256);  // 1025: the clause below
  EXPECT_EQ(rule(dlhs(131200, 128, 128, 768, 2048), h200), pp);
  EXPECT_EQ(rule(fwd(131072, 256, 256, 7168, 2048), h200), pp64);  // deepseek-v3, 512
  EXPECT_EQ(rule(fwd(131072, 128, 128, 2048, 8192), h200), pp64);  // 8192 columns, 1024 rows
  EXPECT_EQ(rule(fwd(1, 128, 1, 2048, 768), h200), pp64);          // one token
  // H200, B row-major, past 64x256: 1024 rows per group below 8192 columns, or 6144 rows.
  EXPECT_EQ(rule(fwd(131072, 128, 128, 2048, 8184), h200), coop256);  // not a multiple of 256
  EXPECT_EQ(rule(fwd(131200, 128, 128, 2048, 8192), h200), pp);       // 8192 columns, 1025 rows
  EXPECT_EQ(rule(fwd(32768, 8, 8, 4096, 14336), h200), pp);           // mixtral, 4096 rows
  EXPECT_EQ(rule(fwd(49144, 8, 8, 4096, 14336), h200), pp);           // 6143
  EXPECT_EQ(rule(fwd(49152, 8, 8, 4096, 14336), h200), coop256);      // 6144
  EXPECT_EQ(rule(fwd(262144, 128, 7, 2048, 768), h200), pp);          // 14336 local rows
  // H200, B column-major, past 64x256: 4096 rows per group and a contraction past 2048.
  EXPECT_EQ(rule(dlhs(32768, 8, 8, 14336, 4096), h200), coop256);  // mixtral, 4096 rows a group
  EXPECT_EQ(rule(dlhs(16384, 8, 8, 14336, 4096), h200), pp);       // 2048
  EXPECT_EQ(rule(dlhs(131072, 32, 32, 2056, 2880), h200), coop256);
  EXPECT_EQ(rule(dlhs(131072, 32, 32, 2048, 2880), h200), pp);
  EXPECT_EQ(rule(dlhs(1048576, 128, 128, 768, 2048), h200), pp);  // qwen3, 8192 rows a group
  // No groups.
  EXPECT_EQ(rule(fwd(1 << 20, 0, 0, 7168, 2048), h100), pp);
  EXPECT_EQ(rule(fwd(1 << 20, 0, 0, 7168, 2048), h200), pp);
}

// kAuto's sm90 schedule for the weight gradient: pingpong on an H200 for 32 groups or fewer and
// fewer than 65536 rows, cooperative 256x128 otherwise and on an H100.
TEST(CudaScheduleRules, WeightGradientGoesToPingpongOnFewGroupsOfFewRows) {
  const auto pingpong = detail::cuda::sm90_contraction_on_pingpong;
  const bool h100 = false, h200 = true;
  EXPECT_TRUE(pingpong(8192, 8, h200));  // mixtral-8x7b, 4096 tokens
  EXPECT_TRUE(pingpong(65535, 8, h200));
  EXPECT_FALSE(pingpong(65536, 8, h200));  // mixtral, 32768 tokens
  EXPECT_TRUE(pingpong(16384, 32, h200));  // gpt-oss-20b, 4096 tokens
  EXPECT_FALSE(pingpong(16384, 33, h200));
  EXPECT_FALSE(pingpong(32768, 128, h200));  // qwen3-30b-a3b, 4096 tokens
  EXPECT_FALSE(pingpong(8192, 8, h100));
  EXPECT_FALSE(pingpong(8192, 0, h200));  // no groups
}

// Which card's rule a device takes: 31 GB/s of memory bandwidth per SM and up are an H200's.
TEST(CudaScheduleRules, BandwidthPerSmTellsTheCards) {
  using detail::cuda::DeviceInfo;
  const auto rich = detail::cuda::sm90_bandwidth_rich;
  EXPECT_FALSE(rich(DeviceInfo{0, 90, 132, 3352}));  // H100 SXM
  EXPECT_TRUE(rich(DeviceInfo{0, 90, 132, 4915}));   // H200
  EXPECT_TRUE(rich(DeviceInfo{0, 90, 132, 31 * 132}));
  EXPECT_FALSE(rich(DeviceInfo{0, 90, 132, 31 * 132 - 1}));
  EXPECT_FALSE(rich(DeviceInfo{0, 90, 0, 4915}));
  EXPECT_FALSE(rich(DeviceInfo{0, 90, 132, 0}));  // bandwidth not reported
}

// The run order of the sm90 run scheduler (cuda/tile_runs.h): Q clusters taking runs of R
// consecutive units. Every unit is taken exactly once, each cluster's units only grow, and a
// cluster's steps s and s + 1 are neighbouring units unless s + 1 starts a new run.
TEST(CudaTileRuns, EveryUnitOnceInRunsOfR) {
  for (uint64_t q_count : {1, 2, 3, 66, 132}) {
    for (uint64_t r : {1, 2, 3, 8}) {
      SCOPED_TRACE(fmt::format("Q={} R={}", q_count, r));
      const detail::cuda::TileRuns order{q_count, r};
      const uint64_t units = 5 * q_count * r + 7;  // a partial last round
      std::vector<int> taken(units, 0);
      for (uint64_t q = 0; q < q_count; ++q) {
        uint64_t last = 0;
        for (uint64_t s = 0;; ++s) {
          const uint64_t u = order.unit(q, s);
          if (s > 0) {
            EXPECT_GT(u, last);
            if (s % r != 0) EXPECT_EQ(u, last + 1);
          }
          if (u >= units) break;
          ++taken[u];
          last = u;
        }
      }
      EXPECT_EQ(std::count(taken.begin(), taken.end(), 1), static_cast<long>(units));
    }
  }
  // Run j belongs to cluster j mod Q.
  const detail::cuda::TileRuns order{4, 3};
  EXPECT_EQ(order.unit(0, 0), 0u);
  EXPECT_EQ(order.unit(1, 0), 3u);
  EXPECT_EQ(order.unit(3, 2), 11u);
  EXPECT_EQ(order.unit(0, 3), 12u);
  EXPECT_EQ(order.unit(2, 4), 19u);
}

// A group's cluster tiles: ceil(extent / tile) rounded up to the cluster, in clusters; nothing
// for an empty extent; unit t of a group is its cluster tile (t mod along_m, t / along_m).
TEST(CudaTileRuns, ClusterTilesOfAGroup) {
  using detail::cuda::cluster_tiles;
  EXPECT_EQ(cluster_tiles(0, 128, 1), 0u);
  EXPECT_EQ(cluster_tiles(-5, 128, 2), 0u);
  EXPECT_EQ(cluster_tiles(1, 128, 1), 1u);
  EXPECT_EQ(cluster_tiles(128, 128, 1), 1u);
  EXPECT_EQ(cluster_tiles(129, 128, 1), 2u);
  EXPECT_EQ(cluster_tiles(256, 256, 2), 1u);  // one 256-row tile: one cluster of two, half idle
  EXPECT_EQ(cluster_tiles(257, 256, 2), 1u);
  EXPECT_EQ(cluster_tiles(513, 256, 2), 2u);
  EXPECT_EQ(cluster_tiles(2048, 256, 2), 4u);  // qwen3-30b-a3b's weight gradient: 8 tiles of M
  std::set<std::tuple<uint64_t, uint64_t>> seen;
  for (uint64_t t = 0; t < 4 * 6; ++t) {
    const auto c = detail::cuda::cluster_tile_of(t, 4);
    EXPECT_LT(c.m, 4u);
    EXPECT_LT(c.n, 6u);
    seen.insert({c.m, c.n});
    if (t > 0 && t % 4 != 0) EXPECT_EQ(c.n, detail::cuda::cluster_tile_of(t - 1, 4).n);
  }
  EXPECT_EQ(seen.size(), 24u);
}

// The run length: at most 8, at least 1, and short enough for 4 runs a cluster; the expected
// units of the two kinds of call.
TEST(CudaTileRuns, RunLengthFromTheExpectedTiles) {
  using detail::cuda::expected_units;
  using detail::cuda::run_length;
  EXPECT_EQ(run_length(0, 132), 1u);
  EXPECT_EQ(run_length(4 * 132 - 1, 132), 1u);
  EXPECT_EQ(run_length(4 * 132 * 3, 132), 3u);
  EXPECT_EQ(run_length(1 << 30, 132), 8u);
  EXPECT_EQ(run_length(100, 0), 1u);
  for (uint64_t units : {600, 1536, 3072, 6144}) {
    const uint64_t r = run_length(units, 132);
    if (r > 1) EXPECT_GE(units / (r * 132), 4u) << units;
  }
  // qwen3-30b-a3b at 4096 tokens: the weight gradient on 256x128 tiles in clusters of 2 (128
  // groups of [2048, 768]: 4 x 6 cluster tiles each), and the forward on 64x256 tiles (32768
  // rows: 512 tiles of M and half a tile a group, 3 of N).
  EXPECT_EQ(expected_units(0, 2048, 128, 768, 256, 128, 2, 1), 128u * 4 * 6);
  EXPECT_EQ(expected_units(32768, 0, 128, 768, 64, 256, 1, 1), (512u + 64) * 3);
  EXPECT_EQ(run_length(128 * 4 * 6, 66), 8u);
  EXPECT_EQ(run_length((512 + 64) * 3, 132), 3u);
  EXPECT_EQ(expected_units(32768, 0, 0, 768, 64, 256, 1, 1), 0u);  // no local groups
  EXPECT_EQ(expected_units(0, 0, 8, 768, 64, 256, 1, 1), 4u * 3);  // no rows: half a tile each
}

// --- The calls as these tests make them -----------------------------------------------------

// Groups whose sizes (and offset, where `device_offset` is set) live on the device.
RaggedDotGroups device_groups(const int32_t* sizes, int64_t count, const int32_t* device_offset,
                              int32_t host_offset = 0) {
  RaggedDotGroups g(std::span<const int32_t>(sizes, static_cast<size_t>(count)), host_offset);
  g.device_offset = device_offset;
  return g;
}

Exec on_device(CUstream_st* stream, void* workspace, size_t workspace_bytes) {
  return {Device::kCuda, stream, workspace, workspace_bytes};
}

RaggedDotOptions with_impl(RaggedDotOptions options, RaggedDotImpl impl) {
  options.impl = impl;
  return options;
}

Status ragged_dot_on_device(ConstTensorView lhs, ConstTensorView rhs, const RaggedDotGroups& g,
                            TensorView out, const RaggedDotOptions& options, const Exec& exec,
                            RaggedDotImpl impl = RaggedDotImpl::kAuto) {
  return ragged_dot(lhs, rhs, g, out, with_impl(options, impl), exec);
}
Status dlhs_on_device(ConstTensorView d_out, ConstTensorView rhs, const RaggedDotGroups& g,
                      TensorView d_lhs, const RaggedDotOptions& options, const Exec& exec,
                      RaggedDotImpl impl = RaggedDotImpl::kAuto) {
  return ragged_dot_dlhs(d_out, rhs, g, d_lhs, with_impl(options, impl), exec);
}
Status drhs_on_device(ConstTensorView lhs, ConstTensorView d_out, const RaggedDotGroups& g,
                      TensorView d_rhs, const RaggedDotOptions& options, const Exec& exec,
                      RaggedDotImpl impl = RaggedDotImpl::kAuto) {
  return ragged_dot_drhs(lhs, d_out, g, d_rhs, with_impl(options, impl), exec);
}

// --- Host-side checks: made before anything touches the device --------------------------------

TEST(CudaBadInput, ShapesDtypesAndGroupsAreCheckedOnTheHost) {
  HostTensor lhs(DType::kBF16, {8, 16}), rhs(DType::kBF16, {2, 16, 24}), out(DType::kF32, {8, 24});
  int32_t fake_sizes[4] = {};
  const RaggedDotGroups groups = device_groups(fake_sizes, 4, nullptr, 1);
  RaggedDotOptions opt;
  const Exec exec = on_device(nullptr, nullptr, 0);

  HostTensor bad_out(DType::kF32, {8, 23});
  Status s = ragged_dot_on_device(lhs.in(), rhs.in(), groups, bad_out.mut(), opt, exec);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_EQ(s.argument(), "out.shape");

  HostTensor f32_rhs(DType::kF32, {2, 16, 24});
  s = ragged_dot_on_device(lhs.in(), f32_rhs.in(), groups, out.mut(), opt, exec);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_EQ(s.argument(), "rhs.dtype");

  s = ragged_dot_on_device(lhs.in(), rhs.in(), device_groups(fake_sizes, 1, nullptr), out.mut(),
                           opt, exec);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_EQ(s.argument(), "group_sizes.size()");

  s = ragged_dot_on_device(lhs.in(), rhs.in(), device_groups(nullptr, 4, nullptr), out.mut(), opt,
                           exec);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_EQ(s.argument(), "group_sizes.data");

  // G - E_loc = 2
  s = ragged_dot_on_device(lhs.in(), rhs.in(), device_groups(fake_sizes, 4, nullptr, 3), out.mut(),
                           opt, exec);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_EQ(s.argument(), "group_offset");

  HostTensor d_rhs(DType::kF32, {2, 16, 25}), d_out(DType::kBF16, {8, 24});
  s = drhs_on_device(lhs.in(), d_out.in(), groups, d_rhs.mut(), opt, exec);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_EQ(s.argument(), "d_rhs.shape");

  // f16 is a CUDA dtype only: the CPU entry points name it as unsupported.
  HostTensor h_lhs(DType::kF16, {8, 16}), h_rhs(DType::kF16, {2, 16, 24});
  const int32_t host_sizes[4] = {2, 2, 2, 2};
  s = ragged_dot(h_lhs.in(), h_rhs.in(), host_sizes, out.mut(), opt);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_EQ(s.argument(), "lhs.dtype");
}

TEST(CudaBadInput, BuiltWithoutCudaSaysSo) {
  if (cuda_built()) GTEST_SKIP() << "built with CUDA";
  HostTensor lhs(DType::kBF16, {8, 16}), rhs(DType::kBF16, {2, 16, 24}), out(DType::kF32, {8, 24});
  int32_t fake_sizes[2] = {};
  const Status s = ragged_dot_on_device(lhs.in(), rhs.in(), device_groups(fake_sizes, 2, nullptr),
                                        out.mut(), {}, on_device(nullptr, nullptr, 0));
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s.message();
  EXPECT_EQ(cuda_device_count(), 0);
}

#if MOEKIT_HAS_CUDA

// --- On the GPU ---------------------------------------------------------------------------------

// The device's own figures: a compute capability, SMs, and a memory bandwidth a GPU could have
// (printed, to say which rule this card takes).
TEST(CudaScheduleRules, DeviceInfoReadsTheBandwidth) {
  MOEKIT_REQUIRE_GPU();
  detail::cuda::DeviceInfo info{};
  ASSERT_TRUE(detail::cuda::device_info(&info).ok());
  std::printf("device %d: compute capability %d, %d SMs, %d GB/s (%s's sm90 rule)\n", info.device,
              info.arch, info.sm_count, info.mem_gbps,
              detail::cuda::sm90_bandwidth_rich(info) ? "the H200" : "the H100");
  EXPECT_GE(info.arch, 50);
  EXPECT_GT(info.sm_count, 0);
  EXPECT_GT(info.mem_gbps, 100);
  EXPECT_LT(info.mem_gbps, 100000);
}

// The current device's compute capability, major * 10 + minor.
int current_arch() {
  int device = 0;
  expect_cuda(cudaGetDevice(&device), "cudaGetDevice");
  cudaDeviceProp prop{};
  expect_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  return prop.major * 10 + prop.minor;
}

struct GpuCase {
  int64_t m, K, n;
  std::vector<int32_t> sizes;  // as the device holds them: may be negative or sum past m
  int32_t offset;              // likewise, when device_offset
  int64_t e_loc;
  DType in = DType::kBF16, out = DType::kF32;
  bool transposed = false, accumulate = false, device_offset = false;
  int64_t row_pad = 0;
  int run_tiles = 0;  // the sm90 run-order schedules' run length; 0: their rule
  std::string name;
};
void PrintTo(const GpuCase& c, std::ostream* os) { *os << c.name; }

// Multiples of 1/64 in [-1, 1] in every element, padding included.
void fill_sixty_fourths(HostTensor& t, std::mt19937& rng) {
  std::uniform_int_distribution<int> k(-64, 64);
  for (size_t i = 0; i < t.bytes.size() / dtype_size(t.dtype); ++i) t.set_flat(i, k(rng) / 64.0);
}

// The groups as the device rules read them, written out plainly: negative sizes are 0, the
// offset is clamped into range, and rows past m are dropped from their groups.
struct Sanitized {
  std::vector<int32_t> sizes;
  int32_t offset;
};
Sanitized sanitize(const GpuCase& c) {
  Sanitized s{c.sizes, c.offset};
  const int64_t G = static_cast<int64_t>(c.sizes.size());
  s.offset = static_cast<int32_t>(std::clamp<int64_t>(c.offset, 0, G - c.e_loc));
  int64_t left = c.m;
  for (auto& v : s.sizes) {
    v = static_cast<int32_t>(std::min<int64_t>(std::max(v, 0), left));
    left -= v;
  }
  return s;
}

// A host tensor of the same values in f32, for the reference.
HostTensor as_f32(const HostTensor& t) {
  HostTensor r(DType::kF32, t.shape);
  r.strides = t.strides;
  r.bytes.resize(t.bytes.size() / dtype_size(t.dtype) * 4);
  for (size_t i = 0; i < t.bytes.size() / dtype_size(t.dtype); ++i) r.set_flat(i, t.get_flat(i));
  return r;
}

// Every element of `got` equals `want` (an f32 reference, rounded to got's dtype) exactly.
void expect_equal(const HostTensor& got, const HostTensor& want, const std::string& what) {
  ASSERT_EQ(got.shape, want.shape);
  int failures = 0;
  const int64_t rows = got.shape.size() == 3 ? got.shape[0] * got.shape[1] : got.shape[0];
  const int64_t cols = got.shape.back();
  for (int64_t r = 0; r < rows && failures < 8; ++r) {
    for (int64_t col = 0; col < cols && failures < 8; ++col) {
      const int64_t og = r * got.strides[got.shape.size() - 2] + col;
      const int64_t ow = r * want.strides[want.shape.size() - 2] + col;
      HostTensor one(got.dtype, {1});
      one.set_flat(0, want.get_flat(ow));  // the rounding to got's dtype
      const double g = got.get_flat(og), w = one.get_flat(0);
      if (!(g == w) && !(std::isnan(g) && std::isnan(w))) {
        ADD_FAILURE() << what << " [" << r << ", " << col << "]: got " << g << ", want " << w;
        ++failures;
      }
    }
  }
}

class RaggedDotCuda : public ::testing::TestWithParam<std::tuple<GpuCase, RaggedDotImpl>> {
 protected:
  void SetUp() override {
    c = std::get<0>(GetParam());
    impl = std::get<1>(GetParam());
    clean = sanitize(c);
    opt.rhs_transposed = c.transposed;
    opt.accumulate = c.accumulate;
    ref_opt = opt;
    ref_opt.impl = RaggedDotImpl::kReference;
    detail::cuda::set_sm90_run_tiles_for_tests(c.run_tiles);
  }
  void TearDown() override { detail::cuda::set_sm90_run_tiles_for_tests(0); }
  std::vector<int64_t> rhs_dims() const {
    return c.transposed ? std::vector<int64_t>{c.e_loc, c.n, c.K}
                        : std::vector<int64_t>{c.e_loc, c.K, c.n};
  }
  // Runs `call(groups, exec)` on the device with the case's groups and a fresh workspace; skips
  // the test when the implementation refuses this device or call (kUnimplemented).
  template <class Call>
  void run_on_device(Call call) {
    DeviceTensor sizes(c.sizes.size() * sizeof(int32_t)), offset(sizeof(int32_t));
    sizes.upload(c.sizes.data(), c.sizes.size() * sizeof(int32_t));
    offset.upload(&c.offset, sizeof(int32_t));
    const size_t ws_bytes = ragged_dot_workspace_size(Device::kCuda, c.e_loc);
    DeviceTensor ws(ws_bytes);
    const RaggedDotGroups groups = device_groups(
        static_cast<const int32_t*>(sizes.ptr), static_cast<int64_t>(c.sizes.size()),
        c.device_offset ? static_cast<const int32_t*>(offset.ptr) : nullptr, c.offset);
    const Status s = call(groups, on_device(nullptr, ws.ptr, ws_bytes));
    if (s.code() == StatusCode::kUnimplemented && impl != RaggedDotImpl::kAuto) {
      GTEST_SKIP() << s.message();
    }
    ASSERT_TRUE(s.ok()) << s.message();
    CUDA_OK(cudaDeviceSynchronize());
  }

  // One pass: the inputs x, y and the previous result r drawn at random; the CPU reference
  // (cpu(x, y, r) on f32 copies) and the device call (gpu(x, y, groups, r, exec) on device
  // copies) must agree exactly. poison_nonlocal_rows: x's rows outside the local groups hold NaN
  // on the device, and must not be read.
  template <class Cpu, class Gpu>
  void check_pass(HostTensor x, HostTensor y, HostTensor r, const char* name, Cpu cpu, Gpu gpu,
                  bool poison_nonlocal_rows = false) {
    fill_sixty_fourths(x, rng);
    fill_sixty_fourths(y, rng);
    fill_sixty_fourths(r, rng);  // the previous contents: kept (accumulate) or overwritten
    HostTensor want = as_f32(r), x32 = as_f32(x), y32 = as_f32(y);
    ASSERT_TRUE(cpu(x32.in(), y32.in(), want.mut()).ok());
    if (poison_nonlocal_rows) {
      int64_t begin = 0;
      for (int32_t j = 0; j < clean.offset; ++j) begin += clean.sizes[j];
      int64_t end = begin;
      for (int64_t j = clean.offset; j < clean.offset + c.e_loc; ++j) end += clean.sizes[j];
      for (int64_t row = 0; row < x.shape[0]; ++row) {
        if (row >= begin && row < end) continue;
        for (int64_t k = 0; k < x.shape[1]; ++k) {
          x.set({row, k}, std::numeric_limits<double>::quiet_NaN());
        }
      }
    }
    DeviceTensor dx(x.bytes.size()), dy(y.bytes.size()), dr(r.bytes.size());
    dx.upload(x), dy.upload(y), dr.upload(r);
    run_on_device([&](const RaggedDotGroups& g, const Exec& e) {
      return gpu(dx.view_as<ConstTensorView>(x), dy.view_as<ConstTensorView>(y), g,
                 dr.view_as<TensorView>(r), e);
    });
    if (HasFatalFailure() || IsSkipped()) return;
    dr.download(r);
    expect_equal(r, want, name);
  }

  void check_forward(bool poison_nonlocal_rows) {
    check_pass(
        HostTensor(c.in, {c.m, c.K}, c.row_pad), HostTensor(c.in, rhs_dims()),
        HostTensor(c.out, {c.m, c.n}, c.row_pad), "out",
        [&](auto lhs, auto rhs, auto out) {
          return ragged_dot(lhs, rhs, {clean.sizes, clean.offset}, out, ref_opt);
        },
        [&](auto lhs, auto rhs, const RaggedDotGroups& g, auto out, const Exec& e) {
          return ragged_dot_on_device(lhs, rhs, g, out, opt, e, impl);
        },
        poison_nonlocal_rows);
  }

  GpuCase c;
  RaggedDotImpl impl;
  Sanitized clean;
  RaggedDotOptions opt, ref_opt;
  std::mt19937 rng{99};
};

TEST_P(RaggedDotCuda, Forward) {
  MOEKIT_REQUIRE_GPU();
  check_forward(/*poison_nonlocal_rows=*/false);
}

TEST_P(RaggedDotCuda, InputGradient) {
  MOEKIT_REQUIRE_GPU();
  check_pass(
      HostTensor(c.in, {c.m, c.n}, c.row_pad), HostTensor(c.in, rhs_dims()),
      HostTensor(c.out, {c.m, c.K}, c.row_pad), "d_lhs",
      [&](auto d_out, auto rhs, auto d_lhs) {
        return ragged_dot_dlhs(d_out, rhs, {clean.sizes, clean.offset}, d_lhs, ref_opt);
      },
      [&](auto d_out, auto rhs, const RaggedDotGroups& g, auto d_lhs, const Exec& e) {
        return dlhs_on_device(d_out, rhs, g, d_lhs, opt, e, impl);
      });
}

TEST_P(RaggedDotCuda, WeightGradient) {
  MOEKIT_REQUIRE_GPU();
  check_pass(
      HostTensor(c.in, {c.m, c.K}, c.row_pad), HostTensor(c.in, {c.m, c.n}, c.row_pad),
      HostTensor(c.out, rhs_dims()), "d_rhs",
      [&](auto lhs, auto d_out, auto d_rhs) {
        return ragged_dot_drhs(lhs, d_out, {clean.sizes, clean.offset}, d_rhs, ref_opt);
      },
      [&](auto lhs, auto d_out, const RaggedDotGroups& g, auto d_rhs, const Exec& e) {
        return drhs_on_device(lhs, d_out, g, d_rhs, opt, e, impl);
      });
}

// NaN in the rows of non-local groups must not reach any output.
TEST_P(RaggedDotCuda, NonLocalRowsAreNeverRead) {
  MOEKIT_REQUIRE_GPU();
  check_forward(/*poison_nonlocal_rows=*/true);
}

std::vector<GpuCase> gpu_cases() {
  std::vector<GpuCase> out;
  std::mt19937 rng(11);
  auto add = [&](GpuCase c, const std::string& name) {
    for (DType in : {DType::kBF16, DType::kF16, DType::kF32}) {
      for (DType o : {DType::kF32, in}) {
        GpuCase x = c;
        x.in = in, x.out = o;
        x.name = fmt::format("{}_{}_{}", name, dtype_name(in), dtype_name(o));
        out.push_back(x);
        if (in == DType::kF32) break;
      }
    }
  };
  // The shapes of the CPU tests: odd sizes (portable kernel), and tensor-core-aligned ones.
  for (int64_t m : {0, 1, 7, 111, 500}) {
    add({m, 70, 33, random_sizes(rng, 5, m), 0, 5}, fmt::format("m{}_K70_n33_all", m));
    add({m, 64, 48, random_sizes(rng, 5, m), 0, 5}, fmt::format("m{}_K64_n48_all", m));
  }
  for (int32_t shard : {0, 1, 3}) {
    add({300, 128, 96, random_sizes(rng, 12, 280), shard * 3, 3},
        fmt::format("shard{}of4_partial", shard));
  }
  add({60, 16, 24, {5, 0, 7, 20, 0, 0, 13, 0, 15, 0}, 1, 8}, "empty_groups_edges");
  add({30, 8, 16, {10, 0, 0, 0, 20}, 1, 3}, "all_local_groups_empty");
  for (int g : {0, 3, 7}) {
    std::vector<int32_t> s(8, 0);
    s[g] = 500;
    add({500, 256, 128, s, 0, 8}, fmt::format("all_rows_in_group{}", g));
  }
  add({20, 0, 8, {5, 10, 5}, 1, 2}, "K0");
  add({20, 8, 0, {5, 10, 5}, 1, 2}, "n0");
  add({1000, 512, 256, random_sizes(rng, 64, 1000), 16, 16}, "e64_shard2of4");
  // More groups than the plan kernel scans at once (256): local groups past the first chunk,
  // and local groups on both sides of a chunk boundary.
  add({1200, 64, 32, random_sizes(rng, 600, 1100), 520, 40}, "g600_past_first_chunk");
  add({1200, 64, 32, random_sizes(rng, 600, 1200), 250, 20}, "g600_across_chunks");
  // No local groups at all: every row is non-local.
  add({50, 16, 8, {20, 30}, 1, 0}, "no_local_groups");
  // Device sizes the host never checked: negative, summing past m, an offset out of range.
  add({100, 64, 32, {30, -4, 50, 60, 10}, 1, 3}, "sizes_past_m_and_negative");
  GpuCase far{100, 64, 32, {20, 20, 20, 20}, 9, 2};
  far.device_offset = true;
  add(far, "device_offset_past_the_end");
  GpuCase below{100, 64, 32, {20, 20, 20, 20}, -3, 2};
  below.device_offset = true;
  add(below, "device_offset_negative");
  GpuCase dev{300, 128, 96, random_sizes(rng, 12, 280), 6, 3};
  dev.device_offset = true;
  add(dev, "device_offset_shard2of4");
  // Transposed rhs, accumulate, padded rows (16-byte multiples, and 3 elements: not aligned).
  std::vector<GpuCase> variants;
  for (const GpuCase& c : out) {
    if (c.name.rfind("shard1", 0) == 0 || c.name.rfind("empty_groups", 0) == 0 ||
        c.name.rfind("m111_", 0) == 0 || c.name.rfind("e64", 0) == 0 ||
        c.name.rfind("g600_across", 0) == 0) {
      GpuCase t = c;
      t.transposed = true, t.name += "_T";
      variants.push_back(t);
      GpuCase a = c;
      a.accumulate = true, a.name += "_acc";
      variants.push_back(a);
      GpuCase p = c;
      p.row_pad = 8, p.name += "_rowpad8";
      variants.push_back(p);
      GpuCase q = c;
      q.row_pad = 3, q.transposed = true, q.name += "_rowpad3_T";
      variants.push_back(q);
    }
  }
  out.insert(out.end(), variants.begin(), variants.end());
  return out;
}

// The implementation's name (impl_name) in a test's name: its letters and digits.
std::string impl_tag(RaggedDotImpl impl) {
  std::string tag = impl_name(impl);
  tag.erase(std::remove(tag.begin(), tag.end(), '-'), tag.end());
  return tag;
}

// The CUDA implementations, each in turn (those the device or build lacks skip or are passed
// over), and kAuto.
constexpr RaggedDotImpl kCudaImpls[] = {RaggedDotImpl::kAuto,
                                        RaggedDotImpl::kCudaSm90,
                                        RaggedDotImpl::kCudaSm90Pingpong,
                                        RaggedDotImpl::kCudaSm90Pingpong64x256,
                                        RaggedDotImpl::kCudaSm90Cooperative256,
                                        RaggedDotImpl::kCudaSm90Pingpong64x256Runs,
                                        RaggedDotImpl::kCudaSm90Cooperative256Runs,
                                        RaggedDotImpl::kCudaSm80,
                                        RaggedDotImpl::kCudaPortable};

INSTANTIATE_TEST_SUITE_P(Gpu, RaggedDotCuda,
                         ::testing::Combine(::testing::ValuesIn(gpu_cases()),
                                            ::testing::ValuesIn(kCudaImpls)),
                         [](const auto& info) {
                           return std::get<0>(info.param).name + "_" +
                                  impl_tag(std::get<1>(info.param));
                         });

// The run-order schedules with runs longer than their rule gives these small calls: runs that
// cross group boundaries, skip empty groups and more than 32 groups at a time (the scheduler's
// warp looks at 32), wrap round the clusters more than once, and a last round that leaves some
// clusters idle.
std::vector<GpuCase> run_cases() {
  std::mt19937 rng(23);
  std::vector<GpuCase> base = {
      {1000, 512, 256, random_sizes(rng, 64, 1000), 16, 16},
      {1200, 64, 32, random_sizes(rng, 600, 1200), 250, 20},
      {60, 16, 24, {5, 0, 7, 20, 0, 0, 13, 0, 15, 0}, 1, 8},
      {500, 256, 128, {0, 0, 0, 500, 0, 0, 0, 0}, 0, 8},
      {4000, 64, 512, random_sizes(rng, 128, 4000), 0, 128},
  };
  const char* names[] = {"e64_shard2of4", "g600_across_chunks", "empty_groups_edges",
                         "all_rows_in_group3", "e128_m4000"};
  std::vector<GpuCase> out;
  for (size_t i = 0; i < base.size(); ++i) {
    for (int r : {2, 3, 8}) {
      for (DType o : {DType::kF32, DType::kBF16}) {
        GpuCase c = base[i];
        c.out = o, c.run_tiles = r;
        c.name = fmt::format("{}_bf16_{}_runs{}", names[i], dtype_name(o), r);
        out.push_back(c);
      }
    }
  }
  GpuCase t = out.front();
  t.transposed = true, t.accumulate = true, t.name += "_T_acc";
  out.push_back(t);
  return out;
}
INSTANTIATE_TEST_SUITE_P(
    GpuRuns, RaggedDotCuda,
    ::testing::Combine(::testing::ValuesIn(run_cases()),
                       ::testing::Values(RaggedDotImpl::kCudaSm90Pingpong64x256Runs,
                                         RaggedDotImpl::kCudaSm90Cooperative256Runs)),
    [](const auto& info) {
      return std::get<0>(info.param).name + "_" + impl_tag(std::get<1>(info.param));
    });

// A call captured once in a CUDA graph computes the right answer when replayed after the device
// group sizes and offset change: nothing of them is read on the host, and the launches do not
// depend on them. Each implementation in turn (kAuto, and those the device has).
TEST(RaggedDotCudaGraph, ReplaysFollowTheDeviceSizes) {
  MOEKIT_REQUIRE_GPU();
  const int64_t m = 512, K = 128, n = 64, G = 8, e_loc = 4;
  std::mt19937 rng(5);
  HostTensor lhs(DType::kBF16, {m, K}), rhs(DType::kBF16, {e_loc, K, n}), out(DType::kF32, {m, n});
  fill_sixty_fourths(lhs, rng);
  fill_sixty_fourths(rhs, rng);
  DeviceTensor d_lhs(lhs.bytes.size()), d_rhs(rhs.bytes.size()), d_out(out.bytes.size());
  d_lhs.upload(lhs), d_rhs.upload(rhs);
  DeviceTensor sizes(G * sizeof(int32_t)), offset(sizeof(int32_t));
  const size_t ws_bytes = ragged_dot_workspace_size(Device::kCuda, e_loc);
  DeviceTensor ws(ws_bytes);
  const RaggedDotGroups groups = device_groups(static_cast<const int32_t*>(sizes.ptr), G,
                                               static_cast<const int32_t*>(offset.ptr));
  HostTensor lhs32 = as_f32(lhs), rhs32 = as_f32(rhs);

  for (RaggedDotImpl impl : kCudaImpls) {
    SCOPED_TRACE(impl_tag(impl));
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const Exec exec = on_device(stream, ws.ptr, ws_bytes);
    // Warm up outside the capture (first-call attribute queries, kernel attributes).
    std::vector<int32_t> first = random_sizes(rng, G, m);
    int32_t first_offset = 0;
    sizes.upload(first.data(), G * sizeof(int32_t));
    offset.upload(&first_offset, sizeof(int32_t));
    Status s = ragged_dot_on_device(d_lhs.view_as<ConstTensorView>(lhs),
                                    d_rhs.view_as<ConstTensorView>(rhs), groups,
                                    d_out.view_as<TensorView>(out), {}, exec, impl);
    if (s.code() == StatusCode::kUnimplemented) continue;  // not on this device
    ASSERT_TRUE(s.ok()) << s.message();
    CUDA_OK(cudaStreamSynchronize(stream));

    cudaGraph_t graph;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    s = ragged_dot_on_device(d_lhs.view_as<ConstTensorView>(lhs),
                             d_rhs.view_as<ConstTensorView>(rhs), groups,
                             d_out.view_as<TensorView>(out), {}, exec, impl);
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    ASSERT_TRUE(s.ok()) << s.message();
    cudaGraphExec_t graph_exec;
    CUDA_OK(cudaGraphInstantiate(&graph_exec, graph, 0));

    for (int round = 0; round < 3; ++round) {
      std::vector<int32_t> now = random_sizes(rng, G, m - 37 * round);
      const int32_t now_offset = round;  // 0, 1, 2: shards that overlap differently
      sizes.upload(now.data(), G * sizeof(int32_t));
      offset.upload(&now_offset, sizeof(int32_t));
      fill_sixty_fourths(out, rng);
      d_out.upload(out);
      CUDA_OK(cudaGraphLaunch(graph_exec, stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      HostTensor want = as_f32(out);
      RaggedDotOptions ref;
      ref.impl = RaggedDotImpl::kReference;
      ASSERT_TRUE(ragged_dot(lhs32.in(), rhs32.in(), {now, now_offset}, want.mut(), ref).ok());
      d_out.download(out);
      expect_equal(out, want, fmt::format("round {} out", round));
    }
    cudaGraphExecDestroy(graph_exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  }
}

// A workspace too small or misaligned is an error that names it, before anything is launched.
TEST(RaggedDotCudaWorkspace, TooSmallOrMisalignedIsRefusedBeforeAnyLaunch) {
  MOEKIT_REQUIRE_GPU();
  const int64_t m = 64, K = 64, n = 64, e_loc = 2;
  std::mt19937 rng(3);
  HostTensor lhs(DType::kBF16, {m, K}), rhs(DType::kBF16, {e_loc, K, n}), out(DType::kF32, {m, n});
  fill_sixty_fourths(lhs, rng);
  fill_sixty_fourths(rhs, rng);
  fill_sixty_fourths(out, rng);
  const HostTensor before = out;
  DeviceTensor d_lhs(lhs.bytes.size()), d_rhs(rhs.bytes.size()), d_out(out.bytes.size());
  d_lhs.upload(lhs), d_rhs.upload(rhs), d_out.upload(out);
  const int32_t host_sizes[2] = {30, 34};
  DeviceTensor sizes(sizeof host_sizes);
  sizes.upload(host_sizes, sizeof host_sizes);
  const size_t ws_bytes = ragged_dot_workspace_size(Device::kCuda, e_loc);
  DeviceTensor ws(ws_bytes + 256);
  const RaggedDotGroups groups = device_groups(static_cast<const int32_t*>(sizes.ptr), 2, nullptr);
  for (RaggedDotImpl impl : kCudaImpls) {
    SCOPED_TRACE(impl_tag(impl));
    auto call = [&](void* workspace, size_t bytes) {
      return ragged_dot_on_device(
          d_lhs.view_as<ConstTensorView>(lhs), d_rhs.view_as<ConstTensorView>(rhs), groups,
          d_out.view_as<TensorView>(out), {}, on_device(nullptr, workspace, bytes), impl);
    };
    Status s = call(ws.ptr, 16);
    if (s.code() == StatusCode::kUnimplemented) continue;  // not on this device
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
    EXPECT_EQ(s.argument(), "exec.workspace_bytes");
    s = call(static_cast<char*>(ws.ptr) + 16, ws_bytes);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
    EXPECT_EQ(s.argument(), "exec.workspace");
  }
  CUDA_OK(cudaDeviceSynchronize());
  d_out.download(out);
  expect_equal(out, before, "out (must be untouched)");
}

// The tensor-core implementations take every aligned bf16 and f16 call on the devices they are
// built for, and refuse (kUnimplemented, saying why) the others. The case tests above skip a
// refused implementation, so this is where a wrongful refusal fails.
TEST(RaggedDotCudaDispatch, TensorCoresTakeAlignedCallsOnTheirDevices) {
  MOEKIT_REQUIRE_GPU();
  const int arch = current_arch();
  const int64_t m = 96, e_loc = 3;
  const std::vector<int32_t> host_sizes = {40, 0, 56};
  DeviceTensor sizes(host_sizes.size() * sizeof(int32_t));
  sizes.upload(host_sizes.data(), host_sizes.size() * sizeof(int32_t));
  const RaggedDotGroups groups =
      device_groups(static_cast<const int32_t*>(sizes.ptr), e_loc, nullptr);
  const size_t ws_bytes = ragged_dot_workspace_size(Device::kCuda, e_loc);
  DeviceTensor ws(ws_bytes);
  std::mt19937 rng(17);
  for (DType in : {DType::kBF16, DType::kF16}) {
    for (int64_t K : {64, 70}) {  // 70: not a multiple of 8, no tensor-core kernel takes it
      for (RaggedDotImpl impl : kCudaImpls) {  // the tensor-core ones
        if (impl == RaggedDotImpl::kAuto || impl == RaggedDotImpl::kCudaPortable) continue;
        SCOPED_TRACE(fmt::format("{} K={} {}", dtype_name(in), K, impl_tag(impl)));
        const bool sm80 = impl == RaggedDotImpl::kCudaSm80;
        const bool bf16_only = impl == RaggedDotImpl::kCudaSm90Pingpong ||
                               impl == RaggedDotImpl::kCudaSm90Pingpong64x256 ||
                               impl == RaggedDotImpl::kCudaSm90Cooperative256 ||
                               impl == RaggedDotImpl::kCudaSm90Pingpong64x256Runs ||
                               impl == RaggedDotImpl::kCudaSm90Cooperative256Runs;
        const bool built = sm80 ? MOEKIT_CUDA_SM80 : MOEKIT_CUDA_SM90;
        const bool takes = built && K % 8 == 0 && (sm80 ? arch >= 80 : arch == 90) &&
                           (!bf16_only || in == DType::kBF16);
        HostTensor lhs(in, {m, K}), rhs(in, {e_loc, K, 40}), out(in, {m, 40});
        fill_sixty_fourths(lhs, rng);
        fill_sixty_fourths(rhs, rng);
        DeviceTensor d_lhs(lhs.bytes.size()), d_rhs(rhs.bytes.size()), d_out(out.bytes.size());
        d_lhs.upload(lhs), d_rhs.upload(rhs);
        RaggedDotImpl ran = RaggedDotImpl::kAuto;
        RaggedDotOptions opt;
        opt.ran = &ran;
        const Status s = ragged_dot_on_device(
            d_lhs.view_as<ConstTensorView>(lhs), d_rhs.view_as<ConstTensorView>(rhs), groups,
            d_out.view_as<TensorView>(out), opt, on_device(nullptr, ws.ptr, ws_bytes), impl);
        if (!takes) {
          EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s.message();
          if (bf16_only && built && arch == 90 && K % 8 == 0) {
            EXPECT_NE(s.message().find("bf16 inputs"), std::string::npos) << s.message();
          }
          continue;
        }
        ASSERT_TRUE(s.ok()) << s.message();
        EXPECT_EQ(ran, impl);
        if (impl == RaggedDotImpl::kCudaSm90Pingpong) {  // kAuto's choice on these short groups
          ASSERT_TRUE(ragged_dot_on_device(d_lhs.view_as<ConstTensorView>(lhs),
                                           d_rhs.view_as<ConstTensorView>(rhs), groups,
                                           d_out.view_as<TensorView>(out), opt,
                                           on_device(nullptr, ws.ptr, ws_bytes))
                          .ok());
          EXPECT_STREQ(impl_name(ran), "sm90-pingpong");
        }
        CUDA_OK(cudaDeviceSynchronize());
        d_out.download(out);
        HostTensor want(DType::kF32, {m, 40}), lhs32 = as_f32(lhs), rhs32 = as_f32(rhs);
        RaggedDotOptions ref;
        ref.impl = RaggedDotImpl::kReference;
        ASSERT_TRUE(ragged_dot(lhs32.in(), rhs32.in(), host_sizes, want.mut(), ref).ok());
        expect_equal(out, want, "out");
      }
    }
  }
}

// kAuto on an sm90 build and device runs each pass where the card's rule says, with the
// reference's results (elsewhere whatever takes the call, the same results): G groups of `rows`
// rows each, bf16.
void expect_auto_runs_the_rule(int64_t G, int64_t rows, int64_t K, int64_t n) {
  SCOPED_TRACE(fmt::format("G={} rows={} K={} n={}", G, rows, K, n));
  const bool sm90 = MOEKIT_CUDA_SM90 && current_arch() == 90;
  const int64_t m = rows * G;
  detail::cuda::DeviceInfo info{};
  ASSERT_TRUE(detail::cuda::device_info(&info).ok());
  const bool rich = detail::cuda::sm90_bandwidth_rich(info);
  const RaggedDotImpl fwd_impl = detail::cuda::sm90_row_schedule({m, G, G, K, n, true}, rich);
  const RaggedDotImpl dlhs_impl = detail::cuda::sm90_row_schedule({m, G, G, n, K, false}, rich);
  const RaggedDotImpl drhs_impl = detail::cuda::sm90_contraction_on_pingpong(m, G, rich)
                                      ? RaggedDotImpl::kCudaSm90Pingpong
                                      : RaggedDotImpl::kCudaSm90Cooperative256;
  const std::vector<int32_t> host_sizes(G, static_cast<int32_t>(rows));
  DeviceTensor sizes(host_sizes.size() * sizeof(int32_t));
  sizes.upload(host_sizes.data(), host_sizes.size() * sizeof(int32_t));
  const RaggedDotGroups groups = device_groups(static_cast<const int32_t*>(sizes.ptr), G, nullptr);
  const size_t ws_bytes = ragged_dot_workspace_size(Device::kCuda, G);
  DeviceTensor ws(ws_bytes);
  std::mt19937 rng(23);
  HostTensor lhs(DType::kBF16, {m, K}), rhs(DType::kBF16, {G, K, n}), d_out(DType::kBF16, {m, n});
  fill_sixty_fourths(lhs, rng);
  fill_sixty_fourths(rhs, rng);
  fill_sixty_fourths(d_out, rng);
  HostTensor out(DType::kBF16, {m, n}), d_lhs(DType::kBF16, {m, K}), d_rhs(DType::kBF16, {G, K, n});
  DeviceTensor dl(lhs.bytes.size()), dr(rhs.bytes.size()), dd(d_out.bytes.size()),
      dy(out.bytes.size()), dx(d_lhs.bytes.size()), dw(d_rhs.bytes.size());
  dl.upload(lhs), dr.upload(rhs), dd.upload(d_out);
  RaggedDotImpl ran = RaggedDotImpl::kAuto;
  RaggedDotOptions opt;
  opt.ran = &ran;
  const Exec exec = on_device(nullptr, ws.ptr, ws_bytes);
  ASSERT_TRUE(ragged_dot(dl.view_as<ConstTensorView>(lhs), dr.view_as<ConstTensorView>(rhs), groups,
                         dy.view_as<TensorView>(out), opt, exec)
                  .ok());
  if (sm90) EXPECT_STREQ(impl_name(ran), impl_name(fwd_impl));
  ran = RaggedDotImpl::kAuto;
  ASSERT_TRUE(ragged_dot_dlhs(dd.view_as<ConstTensorView>(d_out), dr.view_as<ConstTensorView>(rhs),
                              groups, dx.view_as<TensorView>(d_lhs), opt, exec)
                  .ok());
  if (sm90) EXPECT_STREQ(impl_name(ran), impl_name(dlhs_impl));
  ran = RaggedDotImpl::kAuto;
  ASSERT_TRUE(ragged_dot_drhs(dl.view_as<ConstTensorView>(lhs), dd.view_as<ConstTensorView>(d_out),
                              groups, dw.view_as<TensorView>(d_rhs), opt, exec)
                  .ok());
  if (sm90) EXPECT_STREQ(impl_name(ran), impl_name(drhs_impl));
  CUDA_OK(cudaDeviceSynchronize());
  dy.download(out), dx.download(d_lhs), dw.download(d_rhs);
  HostTensor want(DType::kF32, {m, n}), want_dx(DType::kF32, {m, K}),
      want_dw(DType::kF32, {G, K, n});
  HostTensor lhs32 = as_f32(lhs), rhs32 = as_f32(rhs), d_out32 = as_f32(d_out);
  RaggedDotOptions ref;
  ref.impl = RaggedDotImpl::kReference;
  ASSERT_TRUE(ragged_dot(lhs32.in(), rhs32.in(), host_sizes, want.mut(), ref).ok());
  ASSERT_TRUE(ragged_dot_dlhs(d_out32.in(), rhs32.in(), host_sizes, want_dx.mut(), ref).ok());
  ASSERT_TRUE(ragged_dot_drhs(lhs32.in(), d_out32.in(), host_sizes, want_dw.mut(), ref).ok());
  expect_equal(out, want, "out");
  expect_equal(d_lhs, want_dx, "d_lhs");
  expect_equal(d_rhs, want_dw, "d_rhs");
}

// Long groups (8192 rows each, 16384 in 2 groups): the forward on cooperative 256x128 on either
// card's rule, the input gradient (its contraction short) and the weight gradient (few groups of
// few rows) where the card's rule says (cooperative 256x128 on an H100, pingpong on an H200).
// Short groups (200 rows each, 4 groups, widths of 256 and 64): on an H200 the forward and input
// gradient on pingpong 64x256, on an H100 on pingpong 128x128.
TEST(RaggedDotCudaDispatch, LongAndShortGroupsRunWhereTheCardsRuleSays) {
  MOEKIT_REQUIRE_GPU();
  // The shapes reach the clauses they are for.
  EXPECT_EQ(detail::cuda::sm90_row_schedule({16384, 2, 2, 64, 72, true}, false),
            RaggedDotImpl::kCudaSm90Cooperative256);
  EXPECT_EQ(detail::cuda::sm90_row_schedule({16384, 2, 2, 64, 72, true}, true),
            RaggedDotImpl::kCudaSm90Cooperative256);
  EXPECT_EQ(detail::cuda::sm90_row_schedule({800, 4, 4, 64, 256, true}, true),
            RaggedDotImpl::kCudaSm90Pingpong64x256);
  expect_auto_runs_the_rule(2, 8192, 64, 72);
  expect_auto_runs_the_rule(4, 200, 64, 256);
}

#endif  // MOEKIT_HAS_CUDA

}  // namespace
}  // namespace moekit
