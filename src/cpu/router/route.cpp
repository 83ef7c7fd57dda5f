// The router on the CPU: tokens split over the OpenMP threads, each row's exp / sigmoid /
// softplus, reductions and top-k in Highway vector code (row_ops.cpp), output rows built in
// scratch and written once (streamed when large), and no allocation after a thread's first call
// (its scratch rows are thread-local and only grow).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu/convert.h"
#include "cpu/router/problems.h"

namespace moekit::detail {
namespace {

// Parallel over rows when there is enough work to pay for waking the threads.
constexpr int64_t kMinElementsPerThread = 1 << 14;

// The backward gathers the scattered values it needs for this many rows in one tight loop before
// it works on them, so that their loads overlap instead of each row's waiting behind the long
// work of the row before (measured with the vector-built output rows:
// bench/results/router-cpu-2026-11-22).
constexpr int64_t kGatherRows = 32;

// The best `cap` (value, index) pairs pushed so far, best first. A value replaces only a strictly
// smaller one, so when candidates arrive in index order the lower index wins a tie. NaN never
// displaces a value already held.
class TopList {
 public:
  void reset(int32_t cap) {
    cap_ = cap;
    n_ = 0;
    if (val_.size() < static_cast<size_t>(cap)) {
      val_.resize(cap);
      idx_.resize(cap);
    }
  }
  bool full() const { return n_ == cap_; }
  void push(float v, int32_t i) {
    int32_t pos;
    if (n_ < cap_) {
      pos = n_++;
    } else if (v > val_[cap_ - 1]) {
      pos = cap_ - 1;
    } else {
      return;
    }
    for (; pos > 0 && v > val_[pos - 1]; --pos) {
      val_[pos] = val_[pos - 1];
      idx_[pos] = idx_[pos - 1];
    }
    val_[pos] = v;
    idx_[pos] = i;
  }
  // Pushes key[begin, end), skipping quickly past values that cannot enter.
  void push_range(const float* key, int32_t begin, int32_t end) {
    int32_t e = begin;
    for (; e < end && !full(); ++e) push(key[e], e);
    for (; e < end; ++e) {
      if (key[e] > val_[cap_ - 1]) push(key[e], e);
    }
  }
  int32_t size() const { return n_; }
  float value(int32_t i) const { return val_[i]; }
  int32_t index(int32_t i) const { return idx_[i]; }

 private:
  std::vector<float> val_;
  std::vector<int32_t> idx_;
  int32_t cap_ = 0, n_ = 0;
};

// Per-thread scratch, grown to the largest E and k seen.
struct Scratch {
  std::vector<float> x, s, key, aux;  // [E]
  std::vector<int32_t> candidates;    // [E]
  std::vector<float> values;          // [E + 64]
  std::vector<float> w;               // [k]
  std::vector<float> gathered;        // [2, kGatherRows, k]: a block's chosen logits and g
  std::vector<int32_t> chosen, top;   // [k + 1]
  std::vector<int32_t> kept_groups;   // [num_groups]
  std::vector<float> probs_block;     // [kLaneRows * (E + kRowWorkPad)]: blocks of output rows
  std::vector<float> map_block;       // [kLaneRows * (E + kRowWorkPad)]
  StreamQueue queue;                  // the streamed rows of the last block, not yet written
  TopList list;                       // the scalar fallback, and the group choice
  std::vector<float> lanes;           // route_lanes's work
  std::vector<float> zero_bias;       // [E] zeros: route_lanes's bias when there is none
  std::vector<int32_t> lane_chosen;   // [kLaneRows, k]
  std::vector<float> lane_w;          // [kLaneRows, k]

  void reserve(int64_t E, int32_t k, int32_t groups) {
    if (x.size() < static_cast<size_t>(E)) {
      x.resize(E);
      s.resize(E);
      key.resize(E);
      aux.resize(E);
      candidates.resize(E);
      values.resize(E + 64);
      probs_block.resize(kLaneRows * (E + kRowWorkPad));
      map_block.resize(kLaneRows * (E + kRowWorkPad));
    }
    if (w.size() < static_cast<size_t>(k)) {
      w.resize(k);
      gathered.resize(2 * kGatherRows * k);
      chosen.resize(k + 1);
      top.resize(k + 1);
    }
    if (kept_groups.size() < static_cast<size_t>(groups)) kept_groups.resize(groups);
  }
  void reserve_lanes(int64_t E, int32_t k, int32_t groups) {
    const auto floats = static_cast<size_t>(route_lanes_work_floats(E, groups, k));
    if (lanes.size() < floats) lanes.resize(floats);
    if (zero_bias.size() < static_cast<size_t>(E)) zero_bias.resize(E, 0.0f);
    if (lane_w.size() < static_cast<size_t>(kLaneRows * k)) {
      lane_chosen.resize(kLaneRows * k);
      lane_w.resize(kLaneRows * k);
    }
  }
};

// The top k of key[0, n) into out[0, k) (indices relative to key), best first. The vector path
// filters to the few candidates that can make the top k and ranks them against each other; rows
// with NaN take the insertion list.
void select_top(const float* key, int32_t n, int32_t k, Scratch& s, int32_t* out) {
  if (n >= 2 * k && row_top_k(key, n, k, s.candidates.data(), s.values.data(), out)) return;
  s.list.reset(k);
  s.list.push_range(key, 0, n);
  for (int32_t i = 0; i < k; ++i) out[i] = s.list.index(i);
}

Scratch& thread_scratch(int64_t E, int32_t k, int32_t groups) {
  thread_local Scratch scratch;
  scratch.reserve(E, k, groups);
  return scratch;
}

// Asks for row t of v ahead of its use (rows are processed in order; the hardware prefetcher
// does not see across the per-row work soon enough).
[[gnu::always_inline]] inline void prefetch_row(const ConstTensorView& v, int64_t t) {
  if (t < v.shape[0]) prefetch_bytes(row_ptr(v, t), v.shape[1] * dtype_size(v.dtype));
}

// Loads row t of a [T, E] f32 | bf16 tensor as f32. Returns a pointer to it: the tensor's own row
// when it is f32 already, else `buf`.
const float* row_as_float(const ConstTensorView& v, int64_t t, float* buf) {
  const char* row = row_ptr(v, t);
  if (v.dtype == DType::kF32) return reinterpret_cast<const float*>(row);
  load_row_as_float(row, v.dtype, v.shape[1], buf);
  return buf;
}

// The activation of sigmoid-family scores into out; returns their sum.
float activation_row(RouterScore score, const float* x, float* out, int64_t n) {
  return score == RouterScore::kSigmoid ? row_sigmoid(x, out, n) : row_sqrt_softplus(x, out, n);
}

float sigmoid(float x) {
  const float e = std::exp(-std::fabs(x));
  return x >= 0 ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

// d activation / dx from x and s = activation(x).
float activation_grad(RouterScore score, float x, float s) {
  if (score == RouterScore::kSigmoid) return s * (1.0f - s);
  return s > 0.0f ? sigmoid(x) / (2.0f * s) : 0.0f;
}

// Chooses the k experts of one row from key[E]: s.chosen[0, k) in choice order (best first).
void choose_experts(const RouteOptions& o, int64_t E, Scratch& s) {
  int32_t* chosen = s.chosen.data();
  if (o.num_groups == 0) {
    select_top(s.key.data(), static_cast<int32_t>(E), o.k, s, chosen);
    return;
  }
  // Group-limited: each group's score is the sum of its top k / group_topk keys; keep the best
  // group_topk groups. Their keys, copied side by side in group order, keep index order, so ties
  // still go to the lower expert.
  const int32_t per_group = static_cast<int32_t>(E / o.num_groups);
  const int32_t per_group_k = o.k / o.group_topk;
  int32_t* top = s.top.data();
  float* group_score = s.aux.data();  // [num_groups]
  if (per_group_k <= 4) {
    group_top_sums(s.key.data(), o.num_groups, per_group, per_group_k, s.values.data(),
                   group_score);
  } else {
    for (int32_t g = 0; g < o.num_groups; ++g) {
      const float* key = s.key.data() + g * per_group;
      select_top(key, per_group, per_group_k, s, top);
      float sum = 0.0f;
      for (int32_t i = 0; i < per_group_k; ++i) sum += key[top[i]];
      group_score[g] = sum;
    }
  }
  // Keep the groups ranked below group_topk (ties to the lower group; NaN below everything),
  // in group order; branchless, as there are few groups.
  int32_t* kept = s.kept_groups.data();
  int32_t n_kept = 0;
  for (int32_t g = 0; g < o.num_groups; ++g) {
    group_score[g] = std::isnan(group_score[g]) ? -HUGE_VALF : group_score[g];
  }
  for (int32_t g = 0; g < o.num_groups; ++g) {
    int32_t rank = 0;
    for (int32_t h = 0; h < o.num_groups; ++h) {
      rank += (group_score[h] > group_score[g]) | ((group_score[h] == group_score[g]) & (h < g));
    }
    kept[n_kept] = g;
    n_kept += rank < o.group_topk;
  }
  float* packed = s.aux.data();  // [group_topk * per_group]
  for (int32_t i = 0; i < o.group_topk; ++i) {
    std::memcpy(packed + i * per_group, s.key.data() + kept[i] * per_group,
                per_group * sizeof(float));
  }
  select_top(packed, o.group_topk * per_group, o.k, s, chosen);
  for (int32_t i = 0; i < o.k; ++i) {
    chosen[i] = kept[chosen[i] / per_group] * per_group + chosen[i] % per_group;
  }
}

// Which outputs of a call are streamed (see worth_streaming).
struct Streaming {
  bool probs = false, map = false, d_logits = false;
};

// Chooses and weighs row t with the row kernels: s.chosen[0, k) and s.w[0, k), in the output
// order.
void choose_and_weigh_row(const RouteProblem& p, int64_t t, Scratch& s) {
  const RouteOptions& o = p.options;
  const int64_t E = p.logits.shape[1];
  const int32_t k = o.k;
  prefetch_row(p.logits, t + 2);
  const float* x = row_as_float(p.logits, t, s.x.data());
  // A row holding a NaN follows router.h's NaN rule (the reference's), which the fast kernels
  // (max, exp, ranking) do not keep.
  if (row_has_nan(x, E)) {
    route_row_ref(o, x, E, s.chosen.data(), s.w.data());
    return;
  }

  // s.s: the scores weights are taken from; s.key: the scores experts are chosen by.
  const bool post_softmax = o.score == RouterScore::kSoftmax && !o.pre_softmax;
  if (post_softmax) {
    std::memcpy(s.key.data(), x, E * sizeof(float));
  } else if (o.score == RouterScore::kSoftmax) {
    const float sum = row_exp_shifted(x, row_max(x, E), s.s.data(), E);
    const float inv = 1.0f / sum;
    for (int64_t e = 0; e < E; ++e) s.key[e] = s.s[e] *= inv;
  } else {
    activation_row(o.score, x, s.s.data(), E);
    if (o.expert_bias.empty()) {
      std::memcpy(s.key.data(), s.s.data(), E * sizeof(float));
    } else {
      for (int64_t e = 0; e < E; ++e) s.key[e] = s.s[e] + o.expert_bias[e];
    }
  }
  choose_experts(o, E, s);

  // Weights of the chosen, in choice order.
  float* w = s.w.data();
  int32_t* chosen = s.chosen.data();
  if (post_softmax) {
    float* xc = s.aux.data();  // [k] logits of the chosen; xc[0] the largest
    for (int32_t i = 0; i < k; ++i) xc[i] = x[chosen[i]];
    const float sum = row_exp_shifted(xc, xc[0], w, k);
    for (int32_t i = 0; i < k; ++i) w[i] /= sum;
  } else {
    float sum = kNormEps;
    for (int32_t i = 0; i < k; ++i) sum += w[i] = s.s[chosen[i]];
    if (o.score != RouterScore::kSoftmax && k > 1) {
      for (int32_t i = 0; i < k; ++i) w[i] /= sum;
    }
  }
  // Scale, and order by descending weight, ties to the lower index. The choice order is already
  // the weight order unless a bias reordered it; then each takes its rank without branching.
  bool ordered = true;
  for (int32_t i = 0; i < k; ++i) {
    w[i] *= o.scaling_factor;
    if (i > 0) ordered &= (w[i] < w[i - 1]) | ((w[i] == w[i - 1]) & (chosen[i] > chosen[i - 1]));
  }
  if (!ordered) {
    // Ranks must form a permutation even with NaN weights: compare NaN as below everything.
    float* key = s.key.data();  // [k], done with after choose_experts
    for (int32_t i = 0; i < k; ++i) key[i] = std::isnan(w[i]) ? -HUGE_VALF : w[i];
    float* w_sorted = s.values.data();
    int32_t* e_sorted = s.top.data();
    for (int32_t i = 0; i < k; ++i) {
      int32_t rank = 0;
      for (int32_t j = 0; j < k; ++j) {
        // Bitwise, not short-circuit: no branch on the data.
        rank += (key[j] > key[i]) | ((key[j] == key[i]) & (chosen[j] < chosen[i]));
      }
      w_sorted[rank] = w[i];
      e_sorted[rank] = chosen[i];
    }
    std::memcpy(w, w_sorted, k * sizeof(float));
    std::memcpy(chosen, e_sorted, k * sizeof(int32_t));
  }
}

// Rows [t0, t1) of a built block (row t at block + (t - t0) * stride) to out: plain copies, or
// when `stream`, queued for streaming (queue) or streamed at once (no queue).
void write_block(const TensorView& out, int64_t t0, int64_t t1, const char* block, size_t stride,
                 size_t row_bytes, bool stream, StreamQueue* queue) {
  const auto write = [&](char* dst, const char* src, size_t bytes) {
    if (!stream) {
      std::memcpy(dst, src, bytes);
    } else if (queue) {
      queue->push(dst, src, bytes);
    } else {
      stream_bytes(dst, src, bytes);
    }
  };
  // Rows back to back in the block and in the output go as one run.
  if (stride == row_bytes && out.stride[0] * dtype_size(out.dtype) == row_bytes) {
    write(row_ptr(out, t0), block, (t1 - t0) * row_bytes);
    return;
  }
  for (int64_t t = t0; t < t1; ++t) write(row_ptr(out, t), block + (t - t0) * stride, row_bytes);
}

// Asks for the lines of rows [t0, t1) of the outputs written with plain stores, to be written
// after the block's kernel: their stores then find them in cache instead of stalling on them.
// (No lambda or helper that only prefetches: GCC would delete it; see prefetch_bytes.)
[[gnu::always_inline]] inline void prefetch_plain_outputs(const RouteProblem& p,
                                                          const Streaming& stream, int64_t t0,
                                                          int64_t t1) {
  const TensorView* plain[] = {stream.probs ? nullptr : &p.out.probs,
                               stream.map ? nullptr : &p.out.routing_map, &p.out.topk_indices,
                               &p.out.topk_weights};
  for (const TensorView* v : plain) {
    if (!v || !v->data) continue;
    const size_t row_bytes = v->shape[1] * dtype_size(v->dtype);
    for (int64_t t = t0; t < t1; ++t) prefetch_bytes(row_ptr(*v, t), row_bytes);
  }
}

// Writes the outputs of rows [t0, t1) from their chosen experts and weights (row t at
// (t - t0) * k of each, in the output order). probs and routing_map are built for all the rows
// at once, and their streamed rows go through `queue` when one is given: they stay in the
// scratch's blocks until the queue is drained.
void write_route_rows(const RouteProblem& p, int64_t t0, int64_t t1, const int32_t* chosen,
                      const float* w, const Streaming& stream, Scratch& s, StreamQueue* queue) {
  const int32_t k = p.options.k;
  const int64_t E = p.logits.shape[1];
  const RouteOutputs& out = p.out;
  size_t stride;
  if (out.probs.data) {
    const char* block =
        build_sparse_rows(out.probs.dtype, /*sum=*/false, E, t1 - t0, chosen, w,
                          /*row_step=*/k, /*slot_step=*/1, k, s.probs_block.data(), &stride);
    write_block(out.probs, t0, t1, block, stride, E * dtype_size(out.probs.dtype), stream.probs,
                queue);
  }
  if (out.routing_map.data) {
    const char* block = build_map_rows(E, t1 - t0, chosen, k, s.map_block.data(), &stride);
    write_block(out.routing_map, t0, t1, block, stride, E, stream.map, queue);
  }
  // [rows, k] each; one copy when the output's rows are back to back too.
  if (out.topk_indices.data) {
    const bool packed = out.topk_indices.stride[0] == k;
    for (int64_t t = t0; t < t1; t += packed ? t1 - t0 : 1) {
      std::memcpy(row_ptr(out.topk_indices, t), chosen + (t - t0) * k,
                  (packed ? t1 - t0 : 1) * k * sizeof(int32_t));
    }
  }
  if (out.topk_weights.data) {
    const bool packed = out.topk_weights.stride[0] == k;
    for (int64_t t = t0; t < t1; t += packed ? t1 - t0 : 1) {
      store_row_from_float(w + (t - t0) * k, (packed ? t1 - t0 : 1) * k,
                           row_ptr(out.topk_weights, t), out.topk_weights.dtype);
    }
  }
}

void route_row(const RouteProblem& p, int64_t t, const Streaming& stream, Scratch& s) {
  choose_and_weigh_row(p, t, s);
  write_route_rows(p, t, t + 1, s.chosen.data(), s.w.data(), stream, s, nullptr);
}

// Row t's gathered inputs: g[i * step], the cotangent of chosen weight i times the scaling
// factor, and (when xc is not null) xc[i * step], the logit of chosen expert i, as f32.
void gather_chosen(const RouteBackwardProblem& p, int64_t t, float* g, float* xc, int64_t step) {
  const int32_t k = p.options.k;
  const auto* idx = reinterpret_cast<const int32_t*>(row_ptr(p.topk_indices, t));
  const char* d_probs = p.d_probs.data ? row_ptr(p.d_probs, t) : nullptr;
  const char* d_w = p.d_topk_weights.data ? row_ptr(p.d_topk_weights, t) : nullptr;
  for (int32_t i = 0; i < k; ++i) {
    float gi = 0.0f;
    if (d_probs) gi += load_as_float(d_probs, p.d_probs.dtype, idx[i]);
    if (d_w) gi += load_as_float(d_w, p.d_topk_weights.dtype, i);
    g[i * step] = gi * p.options.scaling_factor;
  }
  if (!xc) return;
  const char* logits_row = row_ptr(p.logits, t);
  for (int32_t i = 0; i < k; ++i) {
    xc[i * step] = load_as_float(logits_row, p.logits.dtype, idx[i]);
  }
}

// Pre-softmax: s = softmax(x), w_i = s[idx_i]; dx = s * (ge - <ge, s>) with ge = g scattered to
// idx. Every logit gets gradient.
void backward_pre_softmax_row(const RouteBackwardProblem& p, int64_t t, const float* g,
                              const Streaming& stream, Scratch& s) {
  const int64_t E = p.logits.shape[1];
  const int32_t k = p.options.k;
  const auto* idx = reinterpret_cast<const int32_t*>(row_ptr(p.topk_indices, t));
  const float* x = row_as_float(p.logits, t, s.x.data());
  float* dx = s.aux.data();  // [E]
  float* sm = s.s.data();
  // A row holding a NaN has NaN probabilities (router.h), so its whole gradient is NaN, as the
  // formula gives; the fast max and exp would not keep the NaN.
  if (row_has_nan(x, E)) {
    std::fill(dx, dx + E, std::numeric_limits<float>::quiet_NaN());
  } else {
    const float inv = 1.0f / row_exp_shifted(x, row_max(x, E), sm, E);
    float dot = 0.0f;
    for (int32_t i = 0; i < k; ++i) dot += g[i] * sm[idx[i]] * inv;
    const float scale = -dot * inv;
    for (int64_t e = 0; e < E; ++e) dx[e] = sm[e] * scale;
    for (int32_t i = 0; i < k; ++i) dx[idx[i]] += sm[idx[i]] * inv * g[i];
  }
  char* out = row_ptr(p.d_logits, t);
  if (p.d_logits.dtype == DType::kF32) {
    write_row(out, dx, E * sizeof(float), stream.d_logits);
  } else {
    store_row_from_float(dx, E, out, p.d_logits.dtype);
  }
}

// Aux scores of one row into q (f32 [E]); returns the normaliser of sigmoid-family scores.
float aux_row(RouterScore score, const float* x, float* q, int64_t E) {
  if (row_has_nan(x, E)) {  // NaN scores, as the formulas give (the fast kernels lose NaN)
    std::fill(q, q + E, std::numeric_limits<float>::quiet_NaN());
    return std::numeric_limits<float>::quiet_NaN();
  }
  float norm;
  if (score == RouterScore::kSoftmax) {
    norm = row_exp_shifted(x, row_max(x, E), q, E);
  } else {
    norm = activation_row(score, x, q, E) + kNormEps;
  }
  const float inv = 1.0f / norm;
  for (int64_t e = 0; e < E; ++e) q[e] *= inv;
  return norm;
}

// Runs fn(t0, t1, scratch) on the row blocks [t0, t1) of `block` rows, split over the threads.
template <typename BlockFn>
void for_each_block(int64_t T, int64_t E, int32_t k, int32_t groups, int64_t block, BlockFn fn) {
  const bool parallel = T * E >= 2 * kMinElementsPerThread;
  const int64_t blocks = (T + block - 1) / block;
#pragma omp parallel if (parallel)
  {
    Scratch& s = thread_scratch(E, k, groups);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) fn(b * block, std::min(T, (b + 1) * block), s);
    stream_fence();  // streamed rows are visible before the caller reads them
  }
}

template <typename RowFn>
void for_each_row(int64_t T, int64_t E, int32_t k, int32_t groups, RowFn fn) {
  for_each_block(T, E, k, groups, 1, [&](int64_t t, int64_t, Scratch& s) { fn(t, s); });
}

}  // namespace

Status route_vectorized(const RouteProblem& p) {
  Streaming stream;
  stream.probs = worth_streaming(p.out.probs);
  stream.map = worth_streaming(p.out.routing_map);
  const RouteOptions& o = p.options;
  const int64_t E = p.logits.shape[1];
  if (!route_lanes_apply(o, E)) {
    for_each_row(p.logits.shape[0], E, o.k, o.num_groups,
                 [&](int64_t t, Scratch& s) { route_row(p, t, stream, s); });
    return {};
  }
  // Blocks of rows through the token-lane kernel, the rows it leaves undecided through the row
  // path; each block's streamed outputs are written while the kernel works on the next.
  const int64_t T = p.logits.shape[0], blocks = (T + kLaneRows - 1) / kLaneRows;
  const int32_t k = o.k;
#pragma omp parallel if (T * E >= 2 * kMinElementsPerThread)
  {
    Scratch& s = thread_scratch(E, k, o.num_groups);
    s.reserve_lanes(E, k, o.num_groups);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t t0 = b * kLaneRows, t1 = std::min(T, t0 + kLaneRows);
      int32_t* chosen = s.lane_chosen.data();
      float* w = s.lane_w.data();
      prefetch_plain_outputs(p, stream, t0, t1);
      const uint32_t undecided =
          route_lanes(p, t0, static_cast<int32_t>(t1 - t0), s.zero_bias.data(), s.lanes.data(),
                      chosen, w, s.queue);
      for (int64_t t = t0; t < t1; ++t) {
        if ((undecided >> (t - t0)) & 1) {
          choose_and_weigh_row(p, t, s);
          std::memcpy(chosen + (t - t0) * k, s.chosen.data(), k * sizeof(int32_t));
          std::memcpy(w + (t - t0) * k, s.w.data(), k * sizeof(float));
        }
      }
      write_route_rows(p, t0, t1, chosen, w, stream, s, &s.queue);
    }
    s.queue.flush();
    stream_fence();  // streamed rows are visible before the caller reads them
  }
  return {};
}

Status route_backward_vectorized(const RouteBackwardProblem& p) {
  Streaming stream;
  stream.d_logits = worth_streaming(p.d_logits);
  const int32_t k = p.options.k;
  const int64_t T = p.logits.shape[0], E = p.logits.shape[1];
  if (p.options.score == RouterScore::kSoftmax && p.options.pre_softmax) {
    // Every logit gets gradient: row by row.
    for_each_block(T, E, k, 0, kGatherRows, [&](int64_t t0, int64_t t1, Scratch& s) {
      float* g = s.gathered.data();  // [kGatherRows, k]
      for (int64_t t = t0; t < t1; ++t) gather_chosen(p, t, g + (t - t0) * k, nullptr, 1);
      for (int64_t t = t0; t < t1; ++t) backward_pre_softmax_row(p, t, g + (t - t0) * k, stream, s);
    });
    return {};
  }
  // Only the chosen logits get gradient: gathered for a block of rows, their gradients computed
  // with the rows in vector lanes, and the block's d_logits rows built and written together.
  for_each_block(T, E, k, 0, kLaneRows, [&](int64_t t0, int64_t t1, Scratch& s) {
    s.reserve_lanes(E, k, 0);
    // Slot-major, [k, kLaneRows]: slot i of row t0 + r at i * kLaneRows + r.
    float* g = s.gathered.data();
    float* xc = g + kGatherRows * k;
    float* dxc = s.lane_w.data();
    if (t1 - t0 < kLaneRows) {  // the rows past the end: zeros, for the lanes they fill
      std::fill(g, g + kLaneRows * k, 0.0f);
      std::fill(xc, xc + kLaneRows * k, 0.0f);
    }
    for (int64_t t = t0; t < t1; ++t) {
      prefetch_row(p.logits, t + kLaneRows);  // the next block's, a row at a time
      gather_chosen(p, t, g + (t - t0), xc + (t - t0), kLaneRows);
    }
    route_backward_chosen(p.options, g, xc, dxc);
    // Rows whose chosen logits hold a NaN follow the formulas (NaN gradients), which the lane
    // kernels' exp and activations do not keep: the reference's row.
    for (int64_t r = 0; r < t1 - t0; ++r) {
      bool has_nan = false;
      for (int32_t i = 0; i < k; ++i) has_nan |= std::isnan(xc[i * kLaneRows + r]);
      if (!has_nan) continue;
      std::vector<float> row(3 * static_cast<size_t>(k));  // g, xc, dxc of the row (rare)
      for (int32_t i = 0; i < k; ++i) {
        row[i] = g[i * kLaneRows + r];
        row[k + i] = xc[i * kLaneRows + r];
      }
      route_backward_chosen_row_ref(p.options, row.data(), row.data() + k, row.data() + 2 * k);
      for (int32_t i = 0; i < k; ++i) dxc[i * kLaneRows + r] = row[2 * k + i];
    }
    int32_t* idx = s.lane_chosen.data();  // [kLaneRows, k]
    for (int64_t t = t0; t < t1; ++t) {
      std::memcpy(idx + (t - t0) * k, row_ptr(p.topk_indices, t), k * sizeof(int32_t));
    }
    size_t stride;
    const char* block = build_sparse_rows(p.d_logits.dtype, /*sum=*/true, E, t1 - t0, idx, dxc,
                                          /*row_step=*/1, /*slot_step=*/kLaneRows, k,
                                          s.probs_block.data(), &stride);
    write_block(p.d_logits, t0, t1, block, stride, E * dtype_size(p.d_logits.dtype),
                stream.d_logits, nullptr);
  });
  return {};
}

Status aux_scores_vectorized(const AuxScoresProblem& p) {
  const int64_t E = p.logits.shape[1];
  for_each_row(p.logits.shape[0], E, p.k, 0, [&](int64_t t, Scratch& s) {
    const float* x = row_as_float(p.logits, t, s.x.data());
    float* q = p.scores.data ? reinterpret_cast<float*>(row_ptr(p.scores, t)) : s.s.data();
    aux_row(p.score, x, q, E);
    if (p.routing_map.data) {
      auto* map = reinterpret_cast<uint8_t*>(row_ptr(p.routing_map, t));
      std::memset(map, 0, E);
      int32_t* top = s.top.data();
      select_top(q, static_cast<int32_t>(E), p.k, s, top);
      for (int32_t i = 0; i < p.k; ++i) map[top[i]] = 1;
    }
  });
  return {};
}

Status aux_scores_backward_vectorized(const AuxScoresBackwardProblem& p) {
  const int64_t E = p.logits.shape[1];
  for_each_row(p.logits.shape[0], E, 1, 0, [&](int64_t t, Scratch& s) {
    const float* x = row_as_float(p.logits, t, s.x.data());
    const float* dq = row_as_float(p.d_scores, t, s.key.data());
    float* q = s.s.data();
    float* dx = s.aux.data();
    const float norm = aux_row(p.score, x, q, E);
    const float dot = row_dot(dq, q, E);
    if (p.score == RouterScore::kSoftmax) {
      for (int64_t e = 0; e < E; ++e) dx[e] = q[e] * (dq[e] - dot);
    } else {
      // q = s / norm: ds = (dq - <dq, q>) / norm; dx = ds * activation'(x), s = q * norm.
      const float inv = 1.0f / norm;
      for (int64_t e = 0; e < E; ++e) {
        dx[e] = (dq[e] - dot) * inv * activation_grad(p.score, x[e], q[e] * norm);
      }
    }
    store_row_from_float(dx, E, row_ptr(p.d_logits, t), p.d_logits.dtype);
  });
  return {};
}

}  // namespace moekit::detail
