// The router on CUDA (router_cuda.h): route and its backward, the aux-loss scores and theirs, the
// load-balancing and z losses, the counts and the bias update. The formulas are the scalar
// reference's (cpu/router/reference.cpp), term for term, in f32 with expf / log1pf; sums over a
// row run as warp reductions, so they round in another order than the CPU's.
//
// Row kernels: one warp per token row, lane l holding elements l, l + 32, ... of the row in
// registers (R of them: E <= 32 R). A choice of k experts is k warp-wide selections (the best
// pick of each lane, then a butterfly of the 32 picks), each marking the element it took; what a
// row needs beyond registers (the chosen experts, their weights, the group scores) is the warp's
// slice of shared memory.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/launch.cuh"
#include "cuda/router_cuda.h"
#include "cuda/rows.cuh"

namespace moekit::detail::cuda {
namespace {

constexpr int kMaxWarps = 4;        // warps of a row kernel's block
constexpr int kMaxPartials = 1024;  // blocks of a loss's first pass: its partial sums

// --- The scores, as reference.cpp computes them ------------------------------------------------

__device__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// sigmoid, or sqrt(softplus(x)) = sqrt(max(x, 0) + log1p(exp(-|x|))).
__device__ float score_of(RouterScore score, float x) {
  if (score == RouterScore::kSigmoid) return sigmoid(x);
  return sqrtf((x < 0.0f ? 0.0f : x) + log1pf(expf(-fabsf(x))));
}

// d score / dx.
__device__ float score_grad(RouterScore score, float x) {
  const float sg = sigmoid(x);
  if (score == RouterScore::kSigmoid) return sg * (1.0f - sg);
  const float s = score_of(score, x);
  return s > 0.0f ? sg / (2.0f * s) : 0.0f;
}

// --- A row in the registers of a warp -----------------------------------------------------------

// Element r of this lane is expert lane + 32 r.
__device__ int64_t expert_of(int lane, int r) { return lane + static_cast<int64_t>(kWarp) * r; }

template <int R>
__device__ void load_row(const Mat& m, int64_t t, int64_t E, int lane, float (&x)[R]) {
  const char* row = m.row(t);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t e = expert_of(lane, r);
    x[r] = e < E ? load_float(row, m.t, e) : 0.0f;
  }
}

template <int R>
__device__ void store_row(const Mat& m, int64_t t, int64_t E, int lane, const float (&v)[R]) {
  char* row = m.row(t);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t e = expert_of(lane, r);
    if (e < E) store_float(row, m.t, e, v[r]);
  }
}

// s = softmax(x) over the row's E elements: exp(x - max) / sum. A NaN, or a max of +-inf, makes
// every s NaN, as in the reference (the sum is NaN).
template <int R>
__device__ void softmax_row(const float (&x)[R], int64_t E, int lane, float (&s)[R]) {
  float m = -INFINITY;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (expert_of(lane, r) < E) m = fmaxf(m, x[r]);
  }
  m = warp_max(m);
  float sum = 0.0f;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    s[r] = expert_of(lane, r) < E ? expf(x[r] - m) : 0.0f;
    sum += s[r];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int r = 0; r < R; ++r) s[r] /= sum;
}

// The aux-loss scores of a row: softmax(x), or act(x) / (sum act(x) + 1e-20). Returns that
// normaliser (1 for softmax).
template <int R>
__device__ float aux_row(RouterScore score, const float (&x)[R], int64_t E, int lane,
                         float (&q)[R]) {
  if (score == RouterScore::kSoftmax) {
    softmax_row(x, E, lane, q);
    return 1.0f;
  }
  float sum = 0.0f;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    q[r] = expert_of(lane, r) < E ? score_of(score, x[r]) : 0.0f;
    sum += q[r];
  }
  const float norm = warp_sum(sum) + kNormEps;
#pragma unroll
  for (int r = 0; r < R; ++r) q[r] /= norm;
  return norm;
}

// Chooses the k best of the row's live elements by key: round j takes the best element not yet
// taken and marks it with rnd[r] = j; lane 0 writes its expert to chosen[j] and val of it to
// vals[j] (when given). k never exceeds the live elements (the host checked k <= E, and the
// groups kept hold at least k); if it did, the rounds past them would take nothing.
template <int R>
__device__ void select_top(const float (&key)[R], const float (&val)[R], const bool (&live)[R],
                           int k, int lane, int (&rnd)[R], int32_t* chosen, float* vals) {
#pragma unroll
  for (int r = 0; r < R; ++r) rnd[r] = -1;
  for (int j = 0; j < k; ++j) {
    Pick p{0.0f, -1};
    float pv = 0.0f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const Pick c{key[r], static_cast<int32_t>(expert_of(lane, r))};
      if (live[r] && rnd[r] < 0 && ahead(c, p)) {
        p = c;
        pv = val[r];
      }
    }
    const Pick best = warp_best(p);
    if (best.e < 0) break;  // uniform across the warp
    const int owner = best.e % kWarp;
    const float v = __shfl_sync(kFullMask, pv, owner);
    if (lane == owner) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r == best.e / kWarp) rnd[r] = j;
      }
    }
    if (lane == 0) {
      chosen[j] = best.e;
      if (vals) vals[j] = v;
    }
  }
}

// A warp's slice of the block's shared memory: k chosen experts with two values each, and, for
// group-limited routing, G group scores and whether each is kept.
struct WarpScratch {
  int32_t* e;
  float* v;
  float* w;
  float* group_score;
  int32_t* group_kept;
};

__host__ __device__ constexpr size_t align16(size_t b) { return (b + 15) / 16 * 16; }
__host__ __device__ constexpr size_t scratch_bytes(int k, int groups) {
  return 3 * align16(4 * static_cast<size_t>(k)) + 2 * align16(4 * static_cast<size_t>(groups));
}

__device__ WarpScratch warp_scratch(unsigned char* smem, int k, int groups) {
  unsigned char* p = smem + (threadIdx.x / kWarp) * scratch_bytes(k, groups);
  const size_t kb = align16(4 * static_cast<size_t>(k)),
               gb = align16(4 * static_cast<size_t>(groups));
  return WarpScratch{reinterpret_cast<int32_t*>(p), reinterpret_cast<float*>(p + kb),
                     reinterpret_cast<float*>(p + 2 * kb), reinterpret_cast<float*>(p + 3 * kb),
                     reinterpret_cast<int32_t*>(p + 3 * kb + gb)};
}

// The rows of a row kernel: one per warp, over the whole grid.
#define MOEKIT_FOR_EACH_ROW(t, T)                                                                 \
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp; \
       t < (T); t += static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp))

// --- route ------------------------------------------------------------------------------------

struct RouteArgs {
  Mat logits, probs, map, indices, weights;
  const float* bias;  // [E] or null
  int64_t T, E;
  int k, groups, group_topk;
  RouterScore score;
  bool pre_softmax;
  float scaling;
};

// Group-limited routing: a group's score is the sum of its k / group_topk best keys, added best
// first; the group_topk best groups stay live, the experts of the others do not.
template <int R>
__device__ void keep_best_groups(const RouteArgs& a, const float (&key)[R], bool (&live)[R],
                                 int lane, const WarpScratch& ws) {
  const int64_t per_group = a.E / a.groups;
  const int n = a.k / a.group_topk;
  int group[R];
#pragma unroll
  for (int r = 0; r < R; ++r) group[r] = static_cast<int>(expert_of(lane, r) / per_group);
  unsigned taken = 0;  // bit r: element r counted in its group's sum
  for (int g = 0; g < a.groups; ++g) {
    float sum = 0.0f;
    for (int j = 0; j < n; ++j) {
      Pick p{0.0f, -1};
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const Pick c{key[r], static_cast<int32_t>(expert_of(lane, r))};
        if (live[r] && group[r] == g && !((taken >> r) & 1u) && ahead(c, p)) p = c;
      }
      const Pick best = warp_best(p);
      if (best.e % kWarp == lane) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if (r == best.e / kWarp) taken |= 1u << r;
        }
      }
      sum += best.key;
    }
    if (lane == 0) ws.group_score[g] = sum;
  }
  __syncwarp();
  for (int g = lane; g < a.groups; g += kWarp) {
    int rank = 0;
    for (int h = 0; h < a.groups; ++h)
      rank += ahead({ws.group_score[h], h}, {ws.group_score[g], g});
    ws.group_kept[g] = rank < a.group_topk;
  }
  __syncwarp();
#pragma unroll
  for (int r = 0; r < R; ++r) live[r] = live[r] && ws.group_kept[group[r]] != 0;
}

template <int R>
__global__ void __launch_bounds__(kMaxWarps* kWarp) route_kernel(RouteArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x % kWarp;
  const WarpScratch ws = warp_scratch(smem, a.k, a.groups);
  const bool post = a.score == RouterScore::kSoftmax && !a.pre_softmax;
  MOEKIT_FOR_EACH_ROW(t, a.T) {
    // val: what the weights are taken from; key: what the experts are chosen by.
    float x[R], val[R], key[R];
    bool live[R];
    int rnd[R];
    load_row(a.logits, t, a.E, lane, x);
#pragma unroll
    for (int r = 0; r < R; ++r) live[r] = expert_of(lane, r) < a.E;
    if (a.score == RouterScore::kSoftmax) {
      if (a.pre_softmax) {
        softmax_row(x, a.E, lane, val);
      } else {
#pragma unroll
        for (int r = 0; r < R; ++r) val[r] = x[r];
      }
#pragma unroll
      for (int r = 0; r < R; ++r) key[r] = val[r];
    } else {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        val[r] = score_of(a.score, x[r]);
        key[r] = a.bias != nullptr && live[r] ? val[r] + a.bias[expert_of(lane, r)] : val[r];
      }
    }
    if (a.groups > 0) keep_best_groups(a, key, live, lane, ws);
    select_top(key, val, live, a.k, lane, rnd, ws.e, ws.v);
    __syncwarp();

    // The weights: softmax over the k chosen logits (post), the chosen scores (pre), or the
    // chosen scores over their sum + 1e-20 (sigmoid, sqrtsoftplus, k > 1); then scaled.
    float m = -INFINITY;
    if (post) {
      for (int j = lane; j < a.k; j += kWarp) m = fmaxf(m, ws.v[j]);
      m = warp_max(m);
    }
    float sum = 0.0f;
    for (int j = lane; j < a.k; j += kWarp) {
      const float w = post ? expf(ws.v[j] - m) : ws.v[j];
      ws.w[j] = w;
      sum += w;
    }
    sum = warp_sum(sum);
    const bool normalise = post || (a.score != RouterScore::kSoftmax && a.k > 1);
    const float denom = post ? sum : sum + kNormEps;
    for (int j = lane; j < a.k; j += kWarp) {
      ws.w[j] = (normalise ? ws.w[j] / denom : ws.w[j]) * a.scaling;
    }
    __syncwarp();

    // Outputs: by descending weight (NaN last, ties to the lower expert), and the dense rows.
    for (int j = lane; j < a.k; j += kWarp) {
      const Pick me{ws.w[j], ws.e[j]};
      int rank = 0;
      for (int i = 0; i < a.k; ++i) rank += ahead({ws.w[i], ws.e[i]}, me);
      if (a.indices.present()) a.indices.row<int32_t>(t)[rank] = me.e;
      if (a.weights.present()) store_float(a.weights, t, rank, me.key);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t e = expert_of(lane, r);
      if (e >= a.E) continue;
      if (a.probs.present()) store_float(a.probs, t, e, rnd[r] >= 0 ? ws.w[rnd[r]] : 0.0f);
      if (a.map.present()) a.map.row<uint8_t>(t)[e] = rnd[r] >= 0;
    }
    __syncwarp();  // the scratch is the next row's
  }
}

// --- route_backward ---------------------------------------------------------------------------

struct RouteBackwardArgs {
  Mat logits, indices, d_probs, d_weights, d_logits;
  int64_t T, E;
  int k;
  RouterScore score;
  bool pre_softmax;
  float scaling;
};

// dx[r] += the values vals[i] of the slots i whose expert (chosen[i]) is element r of this lane.
template <int R>
__device__ void gather_slots(const int32_t* chosen, const float* vals, int k, int lane,
                             float (&dx)[R]) {
  for (int i = 0; i < k; ++i) {
    const int32_t e = chosen[i];
    if (e < 0 || e % kWarp != lane) continue;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r == e / kWarp) dx[r] += vals[i];
    }
  }
}

template <int R>
__global__ void __launch_bounds__(kMaxWarps* kWarp) route_backward_kernel(RouteBackwardArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x % kWarp;
  const WarpScratch ws = warp_scratch(smem, a.k, 0);
  MOEKIT_FOR_EACH_ROW(t, a.T) {
    // g: the cotangent of each chosen weight, times the scaling factor. An index outside
    // [0, E) is no expert: it adds no gradient.
    for (int j = lane; j < a.k; j += kWarp) {
      const int32_t e = a.indices.row<const int32_t>(t)[j];
      const bool valid = e >= 0 && e < a.E;
      float g = 0.0f;
      if (valid && a.d_probs.present()) g += load_float(a.d_probs, t, e);
      if (a.d_weights.present()) g += load_float(a.d_weights, t, j);
      ws.e[j] = valid ? e : -1;
      ws.v[j] = g * a.scaling;
    }
    __syncwarp();
    float dx[R];
#pragma unroll
    for (int r = 0; r < R; ++r) dx[r] = 0.0f;
    if (a.score == RouterScore::kSoftmax && a.pre_softmax) {
      // w_i = s[idx_i], s = softmax(x): dx = s * (ge - <ge, s>), ge the cotangent of s.
      float x[R], s[R], ge[R];
      load_row(a.logits, t, a.E, lane, x);
      softmax_row(x, a.E, lane, s);
#pragma unroll
      for (int r = 0; r < R; ++r) ge[r] = 0.0f;
      gather_slots(ws.e, ws.v, a.k, lane, ge);
      float dot = 0.0f;
#pragma unroll
      for (int r = 0; r < R; ++r) dot += expert_of(lane, r) < a.E ? ge[r] * s[r] : 0.0f;
      dot = warp_sum(dot);
#pragma unroll
      for (int r = 0; r < R; ++r) dx[r] = s[r] * (ge[r] - dot);
    } else {
      // Only the chosen logits get gradient: c_i into ws.w, then gathered by expert. First the
      // chosen logits themselves, in ws.w.
      float m = -INFINITY;
      for (int j = lane; j < a.k; j += kWarp) {
        const float xc = ws.e[j] >= 0 ? load_float(a.logits, t, ws.e[j]) : 0.0f;
        ws.w[j] = xc;
        if (ws.e[j] >= 0) m = fmaxf(m, xc);
      }
      const bool softmax = a.score == RouterScore::kSoftmax;
      // softmax (post): w = softmax(x[idx]), dx[idx] = w * (g - <g, w>).
      // sigmoid / sqrtsoftplus: w = s[idx] / (sum + eps) when k > 1,
      //   ds = (g - <g, w>) / (sum + eps), dx[idx] = ds * s'(x[idx]).
      float sum = 0.0f;
      if (softmax) m = warp_max(m);
      for (int j = lane; j < a.k; j += kWarp) {
        if (ws.e[j] < 0) continue;
        sum += softmax ? expf(ws.w[j] - m) : score_of(a.score, ws.w[j]);
      }
      sum = warp_sum(sum);
      if (!softmax) sum += kNormEps;
      float dot = 0.0f;
      for (int j = lane; j < a.k; j += kWarp) {
        if (ws.e[j] < 0) continue;
        const float w = softmax ? expf(ws.w[j] - m) / sum : score_of(a.score, ws.w[j]) / sum;
        dot += ws.v[j] * w;
      }
      dot = warp_sum(dot);
      for (int j = lane; j < a.k; j += kWarp) {
        if (ws.e[j] < 0) {
          ws.w[j] = 0.0f;
          continue;
        }
        const float xc = ws.w[j], g = ws.v[j];
        if (softmax) {
          const float w = expf(xc - m) / sum;
          ws.w[j] = w * (g - dot);
        } else {
          const float ds = a.k > 1 ? (g - dot) / sum : g;
          ws.w[j] = ds * score_grad(a.score, xc);
        }
      }
      __syncwarp();
      gather_slots(ws.e, ws.w, a.k, lane, dx);
    }
    store_row(a.d_logits, t, a.E, lane, dx);
    __syncwarp();  // the scratch is the next row's
  }
}

// --- aux-loss scores ----------------------------------------------------------------------------

struct AuxArgs {
  Mat logits, scores, map, d_scores, d_logits;
  int64_t T, E;
  int k;
  RouterScore score;
};

template <int R>
__global__ void __launch_bounds__(kMaxWarps* kWarp) aux_scores_kernel(AuxArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x % kWarp;
  const WarpScratch ws = warp_scratch(smem, a.k, 0);
  MOEKIT_FOR_EACH_ROW(t, a.T) {
    float x[R], q[R];
    load_row(a.logits, t, a.E, lane, x);
    aux_row(a.score, x, a.E, lane, q);
    if (a.scores.present()) store_row(a.scores, t, a.E, lane, q);
    if (!a.map.present()) continue;
    bool live[R];
    int rnd[R];
#pragma unroll
    for (int r = 0; r < R; ++r) live[r] = expert_of(lane, r) < a.E;
    select_top(q, q, live, a.k, lane, rnd, ws.e, nullptr);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (live[r]) a.map.row<uint8_t>(t)[expert_of(lane, r)] = rnd[r] >= 0;
    }
    __syncwarp();
  }
}

// softmax: dx = q * (dq - <dq, q>); else dx = (dq - <dq, q>) / norm * s'(x).
template <int R>
__global__ void __launch_bounds__(kMaxWarps* kWarp) aux_scores_backward_kernel(AuxArgs a) {
  const int lane = threadIdx.x % kWarp;
  MOEKIT_FOR_EACH_ROW(t, a.T) {
    float x[R], q[R], dq[R], dx[R];
    load_row(a.logits, t, a.E, lane, x);
    const float norm = aux_row(a.score, x, a.E, lane, q);
    load_row(a.d_scores, t, a.E, lane, dq);
    float dot = 0.0f;
#pragma unroll
    for (int r = 0; r < R; ++r) dot += dq[r] * q[r];  // 0 past E: dq and q are
    dot = warp_sum(dot);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      dx[r] = a.score == RouterScore::kSoftmax ? q[r] * (dq[r] - dot)
                                               : (dq[r] - dot) / norm * score_grad(a.score, x[r]);
    }
    store_row(a.d_logits, t, a.E, lane, dx);
  }
}

// --- Launches of the row kernels ----------------------------------------------------------------

// Calls f(std::integral_constant<int, R>) with the fewest registers per lane that hold E.
template <class F>
void with_lanes(int64_t E, F f) {
  if (E <= 32) return f(std::integral_constant<int, 1>{});
  if (E <= 64) return f(std::integral_constant<int, 2>{});
  if (E <= 128) return f(std::integral_constant<int, 4>{});
  if (E <= 256) return f(std::integral_constant<int, 8>{});
  if (E <= 512) return f(std::integral_constant<int, 16>{});
  f(std::integral_constant<int, 32>{});
}

// The shape of a row kernel's launch: warps per block (4, fewer where a warp's scratch is
// large, so that a block stays within the default 48 KiB of shared memory), the blocks, and
// the shared memory.
struct RowLaunch {
  dim3 grid, block;
  size_t smem;
};
RowLaunch row_launch(int64_t T, size_t warp_scratch) {
  int warps = kMaxWarps;
  while (warps > 1 && warps * warp_scratch > 48 * 1024) warps /= 2;
  const int64_t blocks = std::min<int64_t>((T + warps - 1) / warps, int64_t{1} << 20);
  return {dim3(static_cast<unsigned>(std::max<int64_t>(blocks, 1))),
          dim3(static_cast<unsigned>(warps * kWarp)), warps * warp_scratch};
}

Status check_experts(const char* op, int64_t E) {
  if (E <= kRouterMaxCudaExperts) return {};
  return Status::unimplemented(op, "CUDA router kernels hold at most " +
                                       std::to_string(kRouterMaxCudaExperts) +
                                       " experts per row, not " + std::to_string(E));
}

const float* bias_of(const RouteOptions& o) {
  return o.expert_bias.empty() ? nullptr : o.expert_bias.data();
}

// --- The losses -------------------------------------------------------------------------------

// Each warp's rows summed in double on lane 0, then the block's warps in order: the block's
// partial sum.
__device__ void block_partial(double mine, double* partials) {
  __shared__ double warp_total[kMaxWarps];
  if (threadIdx.x % kWarp == 0) warp_total[threadIdx.x / kWarp] = mine;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int w = 0; w < static_cast<int>(blockDim.x / kWarp); ++w) total += warp_total[w];
    partials[blockIdx.x] = total;
  }
}

// *loss = scale * the sum of n partials: one warp, lane-strided, then a butterfly; the same
// order every time.
__global__ void finish_loss_kernel(const double* partials, int n, double scale, float* loss) {
  double total = 0.0;
  for (int i = threadIdx.x; i < n; i += kWarp) total += partials[i];
  total = warp_sum(total);
  if (threadIdx.x == 0) *loss = static_cast<float>(scale * total);
}

// sum_t <scores[t], tokens_per_expert[b(t)]> per block.
__global__ void __launch_bounds__(kMaxWarps* kWarp)
    balance_partials_kernel(Mat scores, Mat counts, int64_t T, int64_t E, int64_t rows_per_seq,
                            double* partials) {
  const int lane = threadIdx.x % kWarp;
  double mine = 0.0;
  MOEKIT_FOR_EACH_ROW(t, T) {
    const auto* c = counts.row<const int32_t>(t / rows_per_seq);
    float dot = 0.0f;
    for (int64_t e = lane; e < E; e += kWarp)
      dot += load_float(scores, t, e) * static_cast<float>(c[e]);
    mine += warp_sum(dot);
  }
  block_partial(mine, partials);
}

// The row's logsumexp: max + log(sum exp(x - max)), with *sum that sum and *shift the max.
__device__ float logsumexp_row(const Mat& logits, int64_t t, int64_t E, int lane, float* shift,
                               float* sum) {
  float m = -INFINITY;
  for (int64_t e = lane; e < E; e += kWarp) m = fmaxf(m, load_float(logits, t, e));
  m = warp_max(m);
  float s = 0.0f;
  for (int64_t e = lane; e < E; e += kWarp) s += expf(load_float(logits, t, e) - m);
  s = warp_sum(s);
  *shift = m;
  *sum = s;
  return m + logf(s);
}

__global__ void __launch_bounds__(kMaxWarps* kWarp)
    z_partials_kernel(Mat logits, int64_t T, int64_t E, double* partials) {
  const int lane = threadIdx.x % kWarp;
  double mine = 0.0;
  MOEKIT_FOR_EACH_ROW(t, T) {
    float shift, sum;
    const double lse = logsumexp_row(logits, t, E, lane, &shift, &sum);
    mine += lse * lse;
  }
  block_partial(mine, partials);
}

// d_logits[t] = scale * lse * softmax(x_t) = (scale * lse / sum) * exp(x - max).
__global__ void __launch_bounds__(kMaxWarps* kWarp)
    z_backward_kernel(Mat logits, Mat d_logits, int64_t T, int64_t E, float scale) {
  const int lane = threadIdx.x % kWarp;
  MOEKIT_FOR_EACH_ROW(t, T) {
    float shift, sum;
    const float lse = logsumexp_row(logits, t, E, lane, &shift, &sum);
    const float a = scale * lse / sum;
    for (int64_t e = lane; e < E; e += kWarp) {
      store_float(d_logits, t, e, expf(load_float(logits, t, e) - shift) * a);
    }
  }
}

// d_scores[t, e] = float(tokens_per_expert[b(t), e]) * scale, the rows over blockIdx.y.
__global__ void balance_backward_kernel(Mat counts, Mat d_scores, int64_t T, int64_t E,
                                        int64_t rows_per_seq, float scale) {
  for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
    const auto* c = counts.row<const int32_t>(t / rows_per_seq);
    for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < E;
         e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      store_float(d_scores, t, e, static_cast<float>(c[e]) * scale);
    }
  }
}

// The first pass of a loss over T rows: its grid and where its partial sums go.
struct LossLaunch {
  dim3 grid, block;
};
LossLaunch loss_launch(int64_t T) {
  const int64_t blocks = std::min<int64_t>((T + kMaxWarps - 1) / kMaxWarps, kMaxPartials);
  return {dim3(static_cast<unsigned>(std::max<int64_t>(blocks, 1))), dim3(kMaxWarps * kWarp)};
}

// --- Counts and the bias update ------------------------------------------------------------------

constexpr int kCountRows = 64;  // rows a thread counts before it adds to the total

// Thread (column e, chunk c) counts the ones of column e in rows [c * 64, c * 64 + 64), adding
// each sequence's part to counts[b, e].
__global__ void count_kernel(Mat map, Mat counts, int64_t T, int64_t E, int64_t rows_per_seq) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e >= E) return;
  for (int64_t c = blockIdx.y; c * kCountRows < T; c += gridDim.y) {
    const int64_t begin = c * kCountRows, end = begin + kCountRows < T ? begin + kCountRows : T;
    int64_t b = begin / rows_per_seq;
    int n = 0;
    for (int64_t t = begin; t < end; ++t) {
      if (t / rows_per_seq != b) {
        if (n) atomicAdd(counts.row<int32_t>(b) + e, n);
        b = t / rows_per_seq;
        n = 0;
      }
      n += map.row<const uint8_t>(t)[e] != 0;
    }
    if (n) atomicAdd(counts.row<int32_t>(b) + e, n);
  }
}

constexpr int kBiasThreads = 256;

// One block: the mean count (in double, the ints added exactly), then each bias moves by rate
// towards balance.
__global__ void __launch_bounds__(kBiasThreads)
    bias_kernel(Mat counts, int64_t count_stride, Mat bias, int64_t bias_stride, int64_t E,
                float rate) {
  __shared__ double total[kBiasThreads / kWarp];
  const auto* c = reinterpret_cast<const int32_t*>(counts.p);
  double mine = 0.0;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) mine += c[e * count_stride];
  mine = warp_sum(mine);
  if (threadIdx.x % kWarp == 0) total[threadIdx.x / kWarp] = mine;
  __syncthreads();
  double sum = 0.0;
  for (int w = 0; w < kBiasThreads / kWarp; ++w) sum += total[w];
  const double mean = sum / static_cast<double>(E);
  auto* b = reinterpret_cast<float*>(bias.p);
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    const double diff = mean - c[e * count_stride];
    b[e * bias_stride] += rate * static_cast<float>((diff > 0) - (diff < 0));
  }
}

constexpr const char* kOp = "router (CUDA)";

}  // namespace

size_t router_workspace_bytes(int64_t) { return align_up(sizeof(double) * kMaxPartials); }

Status route_cuda(const RouteProblem& p) {
  const RouteOptions& o = p.options;
  const int64_t T = p.logits.shape[0], E = p.logits.shape[1];
  MOEKIT_RETURN_IF_ERROR(check_experts("route", E));
  const RouteArgs a{Mat(p.logits),
                    Mat(p.out.probs),
                    Mat(p.out.routing_map),
                    Mat(p.out.topk_indices),
                    Mat(p.out.topk_weights),
                    bias_of(o),
                    T,
                    E,
                    o.k,
                    o.num_groups,
                    o.group_topk,
                    o.score,
                    o.pre_softmax,
                    o.scaling_factor};
  const RowLaunch l = row_launch(T, scratch_bytes(o.k, o.num_groups));
  with_lanes(E, [&](auto r) {
    route_kernel<decltype(r)::value><<<l.grid, l.block, l.smem, p.exec.stream>>>(a);
  });
  return launch_status(kOp, "the route kernel");
}

Status route_backward_cuda(const RouteBackwardProblem& p) {
  const RouteOptions& o = p.options;
  const int64_t T = p.logits.shape[0], E = p.logits.shape[1];
  MOEKIT_RETURN_IF_ERROR(check_experts("route_backward", E));
  const RouteBackwardArgs a{Mat(p.logits),
                            Mat(p.topk_indices),
                            Mat(p.d_probs),
                            Mat(p.d_topk_weights),
                            Mat(p.d_logits),
                            T,
                            E,
                            o.k,
                            o.score,
                            o.pre_softmax,
                            o.scaling_factor};
  const RowLaunch l = row_launch(T, scratch_bytes(o.k, 0));
  with_lanes(E, [&](auto r) {
    route_backward_kernel<decltype(r)::value><<<l.grid, l.block, l.smem, p.exec.stream>>>(a);
  });
  return launch_status(kOp, "the route backward kernel");
}

Status aux_scores_cuda(const AuxScoresProblem& p) {
  const int64_t T = p.logits.shape[0], E = p.logits.shape[1];
  MOEKIT_RETURN_IF_ERROR(check_experts("aux_loss_scores", E));
  const AuxArgs a{Mat(p.logits), Mat(p.scores), Mat(p.routing_map), Mat(), Mat(), T, E,
                  p.k,           p.score};
  const RowLaunch l = row_launch(T, scratch_bytes(p.k, 0));
  with_lanes(E, [&](auto r) {
    aux_scores_kernel<decltype(r)::value><<<l.grid, l.block, l.smem, p.exec.stream>>>(a);
  });
  return launch_status(kOp, "the aux-loss scores kernel");
}

Status aux_scores_backward_cuda(const AuxScoresBackwardProblem& p) {
  const int64_t T = p.logits.shape[0], E = p.logits.shape[1];
  MOEKIT_RETURN_IF_ERROR(check_experts("aux_loss_scores_backward", E));
  const AuxArgs a{Mat(p.logits), Mat(), Mat(), Mat(p.d_scores), Mat(p.d_logits), T, E, 0, p.score};
  const RowLaunch l = row_launch(T, 0);
  with_lanes(E, [&](auto r) {
    aux_scores_backward_kernel<decltype(r)::value><<<l.grid, l.block, 0, p.exec.stream>>>(a);
  });
  return launch_status(kOp, "the aux-loss scores backward kernel");
}

// The two passes of a loss: partial sums per block into the workspace, then their total.
template <class FirstPass>
Status run_loss(const char* op, const Exec& exec, int64_t T, double scale, float* loss,
                FirstPass first_pass) {
  MOEKIT_RETURN_IF_ERROR(check_workspace(op, exec, router_workspace_bytes(T),
                                         "router_workspace_size(Device::kCuda, T, E)"));
  auto* partials = static_cast<double*>(exec.workspace);
  int n = 0;
  if (T > 0) {
    const LossLaunch l = loss_launch(T);
    first_pass(l.grid, l.block, partials);
    MOEKIT_RETURN_IF_ERROR(launch_status(op, "the loss's partial sums"));
    n = static_cast<int>(l.grid.x);
  }
  finish_loss_kernel<<<1, kWarp, 0, exec.stream>>>(partials, n, scale, loss);
  return launch_status(op, "the loss's total");
}

Status balance_loss_cuda(const BalanceLossProblem& p) {
  const int64_t T = p.scores.shape[0], E = p.scores.shape[1];
  const int64_t B = p.tokens_per_expert.rank == 2 ? p.tokens_per_expert.shape[0] : 1;
  const Mat scores(p.scores), counts(p.tokens_per_expert);
  return run_loss("load_balancing_loss", p.exec, T, p.scale, p.loss,
                  [&](dim3 grid, dim3 block, double* partials) {
                    balance_partials_kernel<<<grid, block, 0, p.exec.stream>>>(
                        scores, counts, T, E, std::max<int64_t>(T / B, 1), partials);
                  });
}

Status balance_loss_backward_cuda(const BalanceBackwardProblem& p) {
  const int64_t T = p.d_scores.shape[0], E = p.d_scores.shape[1];
  const int64_t B = p.tokens_per_expert.rank == 2 ? p.tokens_per_expert.shape[0] : 1;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((E + 255) / 256, 64)),
                  static_cast<unsigned>(std::min<int64_t>(T, 65535)));
  balance_backward_kernel<<<grid, 256, 0, p.exec.stream>>>(
      Mat(p.tokens_per_expert), Mat(p.d_scores), T, E, std::max<int64_t>(T / B, 1), p.scale);
  return launch_status("load_balancing_loss_backward", "the kernel");
}

Status z_loss_cuda(const ZLossProblem& p) {
  const int64_t T = p.logits.shape[1] == 0 ? 0 : p.logits.shape[0], E = p.logits.shape[1];
  const Mat logits(p.logits);
  return run_loss("z_loss", p.exec, T, p.scale, p.loss,
                  [&](dim3 grid, dim3 block, double* partials) {
                    z_partials_kernel<<<grid, block, 0, p.exec.stream>>>(logits, T, E, partials);
                  });
}

Status z_loss_backward_cuda(const ZLossBackwardProblem& p) {
  const int64_t T = p.logits.shape[0], E = p.logits.shape[1];
  const RowLaunch l = row_launch(T, 0);
  z_backward_kernel<<<l.grid, l.block, 0, p.exec.stream>>>(Mat(p.logits), Mat(p.d_logits), T, E,
                                                           p.scale);
  return launch_status("z_loss_backward", "the kernel");
}

Status count_tokens_cuda(const CountProblem& p) {
  const char* op = "count_tokens_per_expert";
  const int64_t T = p.routing_map.shape[0], E = p.routing_map.shape[1];
  const int64_t B = p.counts.rank == 2 ? p.counts.shape[0] : 1;
  const Mat counts(p.counts);
  const size_t pitch = p.counts.rank == 2 ? static_cast<size_t>(counts.ld) : E * sizeof(int32_t);
  MOEKIT_RETURN_IF_ERROR(
      cuda_status(op, "cudaMemset2DAsync",
                  cudaMemset2DAsync(counts.p, pitch, 0, E * sizeof(int32_t), B, p.exec.stream)));
  if (T == 0) return {};
  const dim3 grid(
      static_cast<unsigned>((E + 127) / 128),
      static_cast<unsigned>(std::min<int64_t>((T + kCountRows - 1) / kCountRows, 65535)));
  count_kernel<<<grid, 128, 0, p.exec.stream>>>(Mat(p.routing_map), counts, T, E, T / B);
  return launch_status(op, "the kernel");
}

Status update_expert_bias_cuda(const BiasUpdateProblem& p) {
  bias_kernel<<<1, kBiasThreads, 0, p.exec.stream>>>(
      Mat(p.tokens_per_expert), p.tokens_per_expert.stride[0], Mat(p.expert_bias),
      p.expert_bias.stride[0], p.expert_bias.shape[0], p.rate);
  return launch_status("update_expert_bias", "the kernel");
}

}  // namespace moekit::detail::cuda
