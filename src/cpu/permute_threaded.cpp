// The permutation ops on the CPU threads. permute: tokens split into one contiguous range per
// thread; a counting pass gives every (thread, expert) pair its first row, so that the rows come
// out in (token, slot) order inside each expert with no second sort, and each row is copied once,
// streamed when the output is larger than the caches. Combine and its gradient: one token per
// iteration, its k rows summed in f32 in a thread-local row.
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/convert.h"
#include "cpu/permute_kernels.h"
#include "cpu/stream.h"

namespace moekit::detail {
namespace {

// Below this many bytes moved, one thread.
constexpr int64_t kParallelBytes = 1 << 16;

// A zeroed row of `bytes`, for streaming zeros (grown per thread, only ever zero).
const void* zeros(size_t bytes) {
  thread_local std::vector<char> z;
  if (z.size() < bytes) z.assign(bytes, 0);
  return z.data();
}

// Thread-local f32 scratch, one per call site (kSite), so that each is sized by its own requests
// alone and AddressSanitizer sees one that asks for too little.
template <int kSite>
float* scratch_row(int64_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < static_cast<size_t>(n)) buf.resize(n);
  return buf.data();
}

// The row loops below are compiled for AVX-512, AVX2 and the baseline, picked at load time.
#define MOEKIT_ROW_LOOP \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

// acc[0, n) (+)= w * row[0, n), row f32 | bf16.
template <typename In>
MOEKIT_ROW_LOOP void axpy_typed(float* acc, float w, const In* x, int64_t n, bool first) {
  if (first) {
    for (int64_t h = 0; h < n; ++h) acc[h] = w * as_float(x[h]);
  } else {
    for (int64_t h = 0; h < n; ++h) acc[h] += w * as_float(x[h]);
  }
}
void axpy_row(float* acc, float w, const void* row, DType t, int64_t n, bool first) {
  if (t == DType::kF32) {
    axpy_typed(acc, w, static_cast<const float*>(row), n, first);
  } else {
    axpy_typed(acc, w, static_cast<const bf16_bits*>(row), n, first);
  }
}

// <x, g> in f32 over n, x f32 | bf16, in 16 interleaved partial sums (a vector's worth), so that
// the sum vectorises without reassociation flags.
template <typename In>
MOEKIT_ROW_LOOP float dot_typed(const In* x, const float* g, int64_t n) {
  constexpr int64_t kLanes = 16;
  float part[kLanes] = {};
  int64_t h = 0;
  for (; h + kLanes <= n; h += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) part[j] += as_float(x[h + j]) * g[h + j];
  }
  for (; h < n; ++h) part[h % kLanes] += as_float(x[h]) * g[h];
  float sum = 0.0f;
  for (float v : part) sum += v;
  return sum;
}
float dot_row(const void* x, DType t, const float* g, int64_t n) {
  return t == DType::kF32 ? dot_typed(static_cast<const float*>(x), g, n)
                          : dot_typed(static_cast<const bf16_bits*>(x), g, n);
}

// out[0, n) = w * g[0, n) in f32 | bf16 (rounded to nearest even, NaN kept quiet, as
// float_to_bf16, written without branches so that it vectorises).
MOEKIT_ROW_LOOP void scale_row(const float* g, float w, int64_t n, void* out, DType t) {
  if (t == DType::kF32) {
    auto* o = static_cast<float*>(out);
    for (int64_t h = 0; h < n; ++h) o[h] = w * g[h];
    return;
  }
  auto* o = static_cast<bf16_bits*>(out);
  for (int64_t h = 0; h < n; ++h) {
    const uint32_t u = std::bit_cast<uint32_t>(w * g[h]);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (u >> 16) | 0x0040u;
    o[h] = static_cast<bf16_bits>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
  }
}

// The (prob, position) order that the kProbs policy keeps by: higher prob first (NaN lowest),
// then the earlier (token, slot).
struct SlotKey {
  float prob;
  int64_t pos;  // t * S + s
  bool before(const SlotKey& o) const { return prob != o.prob ? prob > o.prob : pos < o.pos; }
};

float prob_key(const ConstTensorView& probs, int64_t t, int64_t s) {
  const float v = load_as_float(row_ptr(probs, t), probs.dtype, s);
  return v == v ? v : -HUGE_VALF;
}

}  // namespace

Status permute_threaded(const PermuteProblem& p) {
  const PermuteOutputs& out = p.out;
  const int64_t T = p.T, S = p.S, E = p.E;
  const BlockLayout& layout = p.layout;
  const bool by_probs = p.capacity >= 0 && p.options.drop_policy == DropPolicy::kProbs;

  // kProbs: the last kept key of each expert over capacity (the capacity-th best), found by a
  // selection over that expert's slots. Experts within capacity keep all.
  std::vector<SlotKey> last_kept(E, SlotKey{-HUGE_VALF, INT64_MAX});
  if (by_probs) {
    std::vector<std::vector<SlotKey>> keys(E);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t s = 0; s < S; ++s) {
        const int32_t e = slot_expert(p.routing, t, s);
        // Only an expert that keeps `capacity` may have routed more than that.
        if (e >= 0 && layout.kept[e] == p.capacity) {
          keys[e].push_back({prob_key(p.probs, t, s), t * S + s});
        }
      }
    }
    for (int64_t e = 0; e < E; ++e) {
      auto& k = keys[e];
      if (static_cast<int64_t>(k.size()) <= p.capacity) continue;
      if (p.capacity == 0) {
        last_kept[e] = SlotKey{HUGE_VALF, -1};  // keeps nothing: every key is after it
        continue;
      }
      std::nth_element(k.begin(), k.begin() + (p.capacity - 1), k.end(),
                       [](const SlotKey& a, const SlotKey& b) { return a.before(b); });
      last_kept[e] = k[p.capacity - 1];
    }
  }

  const int64_t row_bytes = p.H * static_cast<int64_t>(out.x.data ? dtype_size(out.x.dtype) : 0);
  const bool stream = worth_streaming(out.x);
  const int threads =
      T * S * (row_bytes + 8) >= kParallelBytes ? std::max(1, omp_get_max_threads()) : 1;
  // [thread][expert]: routed slots, then first routed rank; kept slots, then first row.
  std::vector<int64_t> routed(threads * E, 0), kept(threads * E, 0);
  auto* rows_out = static_cast<int32_t*>(out.row_map.data);
  auto* experts_out = rows_out + out.row_map.stride[0];

#pragma omp parallel num_threads(threads)
  {
    const int th = omp_get_thread_num(), nth = omp_get_num_threads();
    const int64_t t0 = T * th / nth, t1 = T * (th + 1) / nth;
    int64_t* my_routed = routed.data() + th * E;
    int64_t* my_kept = kept.data() + th * E;
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t s = 0; s < S; ++s) {
        const int32_t e = slot_expert(p.routing, t, s);
        if (e < 0) continue;
        ++my_routed[e];
        if (by_probs && !last_kept[e].before(SlotKey{prob_key(p.probs, t, s), t * S + s})) {
          ++my_kept[e];
        }
      }
    }
#pragma omp barrier
#pragma omp single
    {
      // Exclusive prefix sums over threads: the first routed rank and the first row of each
      // (thread, expert). Without a capacity every routed slot is kept; with kPosition the kept
      // ones are the first `capacity` routed.
      for (int64_t e = 0; e < E; ++e) {
        int64_t rank = 0, row = layout.start[e];
        for (int i = 0; i < nth; ++i) {
          const int64_t n = routed[i * E + e];
          int64_t k = n;
          if (p.capacity >= 0) {
            k = by_probs ? kept[i * E + e] : std::clamp<int64_t>(p.capacity - rank, 0, n);
          }
          routed[i * E + e] = rank;
          kept[i * E + e] = row;
          rank += n;
          row += k;
        }
      }
    }
    // Rows: each routed slot's rank within its expert decides whether it is kept and where.
    for (int64_t t = t0; t < t1; ++t) {
      const char* src = out.x.data ? row_ptr(p.x, t) : nullptr;
      for (int64_t s = 0; s < S; ++s) {
        const int32_t e = slot_expert(p.routing, t, s);
        int32_t row = -1;
        if (e >= 0) {
          const int64_t rank = my_routed[e]++;
          bool keep = true;
          if (by_probs) {
            keep = !last_kept[e].before(SlotKey{prob_key(p.probs, t, s), t * S + s});
          } else if (p.capacity >= 0) {
            keep = rank < p.capacity;
          }
          if (keep) row = static_cast<int32_t>(my_kept[e]++);
        }
        rows_out[t * out.row_map.stride[1] + s] = row;
        experts_out[t * out.row_map.stride[1] + s] = e;
        if (row < 0) continue;
        if (src) write_row(row_ptr(out.x, row), src, row_bytes, stream);
        if (out.probs.data) {
          store_float(out.probs.data, out.probs.dtype, row * out.probs.stride[0],
                      load_as_float(row_ptr(p.probs, t), p.probs.dtype, s));
        }
      }
    }
    // Zero the padding rows of every block, and the rows past the last block.
    if (out.x.data) {
      const int64_t N = out.x.shape[0];
#pragma omp for schedule(static)
      for (int64_t e = 0; e <= E; ++e) {
        const int64_t begin = e < E ? layout.start[e] + layout.kept[e] : layout.needed;
        const int64_t end = e < E ? layout.start[e] + layout.rows[e] : N;
        for (int64_t r = begin; r < end; ++r) {
          write_row(row_ptr(out.x, r), zeros(row_bytes), row_bytes, stream);
          if (out.probs.data)
            store_float(out.probs.data, out.probs.dtype, r * out.probs.stride[0], 0);
        }
      }
    }
    stream_fence();
  }

  int64_t padding = 0;
  for (int64_t e = 0; e < E; ++e) {
    static_cast<int32_t*>(out.tokens_per_expert.data)[e * out.tokens_per_expert.stride[0]] =
        static_cast<int32_t>(layout.rows[e]);
    if (out.pad_offsets.data) {
      static_cast<int32_t*>(out.pad_offsets.data)[e * out.pad_offsets.stride[0]] =
          static_cast<int32_t>(padding);
    }
    padding += layout.rows[e] - layout.kept[e];
  }
  return {};
}

Status combine_threaded(const CombineProblem& p) {
  const int64_t T = p.row_map.shape[1], S = p.row_map.shape[2], H = p.out.shape[1];
  const auto* rows = static_cast<const int32_t*>(p.row_map.data);
  const bool stream = worth_streaming(p.out);
  const size_t out_bytes = H * dtype_size(p.out.dtype);
  const bool parallel = T * S * H >= kParallelBytes;
  const size_t row_bytes = H * dtype_size(p.rows.dtype);
  // The row after slot s of token t: the token's next routed slot, else the next token's first.
  auto next_row = [&](int64_t t, int64_t s) -> const void* {
    for (int64_t u = t, j = s + 1; u < T && u <= t + 1; ++u, j = 0) {
      for (; j < S; ++j) {
        const int32_t r = rows[u * p.row_map.stride[1] + j];
        if (r >= 0) return row_ptr(p.rows, r);
      }
    }
    return nullptr;
  };
#pragma omp parallel if (parallel)
  {
    float* acc = scratch_row<0>(2 * H);  // [H] f32 sums, then [H] of the output row
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      bool first = true;
      for (int64_t s = 0; s < S; ++s) {
        const int32_t r = rows[t * p.row_map.stride[1] + s];
        if (p.slot_values.data) {
          const float v = r < 0 ? 0.0f
                                : load_as_float(p.row_values.data, p.row_values.dtype,
                                                r * p.row_values.stride[0]);
          store_float(row_ptr(p.slot_values, t), p.slot_values.dtype, s, v);
        }
        if (r < 0) continue;
        prefetch_bytes(next_row(t, s), row_bytes);
        const float w =
            p.weights.data ? load_as_float(row_ptr(p.weights, t), p.weights.dtype, s) : 1.0f;
        axpy_row(acc, w, row_ptr(p.rows, r), p.rows.dtype, H, first);
        first = false;
      }
      if (first) std::fill(acc, acc + H, 0.0f);
      if (p.out.dtype == DType::kF32) {
        write_row(row_ptr(p.out, t), acc, out_bytes, stream);
      } else {
        store_row_from_float(acc, H, acc + H, p.out.dtype);
        write_row(row_ptr(p.out, t), acc + H, out_bytes, stream);
      }
    }
    stream_fence();
  }
  return {};
}

Status scatter_threaded(const ScatterProblem& p) {
  const int64_t T = p.row_map.shape[1], S = p.row_map.shape[2], H = p.d_out.shape[1];
  const int64_t N = p.d_y_perm.shape[0];
  const auto* rows = static_cast<const int32_t*>(p.row_map.data);
  const bool stream = worth_streaming(p.d_y_perm);
  const size_t out_bytes = H * dtype_size(p.d_y_perm.dtype);
  const bool copy_as_is = !p.weights.data && p.d_out.dtype == p.d_y_perm.dtype;
  const size_t y_bytes = p.y_perm.data ? H * dtype_size(p.y_perm.dtype) : 0;
  const bool parallel = (T * S + N) * H >= kParallelBytes;
#pragma omp parallel if (parallel)
  {
    float* buf = scratch_row<1>(2 * H);  // d_out[t] f32 | the output row (f32 | bf16)
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const char* g = row_ptr(p.d_out, t);
      if (!copy_as_is || p.d_weights.data) load_row_as_float(g, p.d_out.dtype, H, buf);
      for (int64_t s = 0; s < S; ++s) {
        const int32_t r = rows[t * p.row_map.stride[1] + s];
        if (p.d_weights.data) {
          float dw = 0.0f;
          if (r >= 0) {
            if (s + 1 < S && rows[t * p.row_map.stride[1] + s + 1] >= 0) {
              prefetch_bytes(row_ptr(p.y_perm, rows[t * p.row_map.stride[1] + s + 1]), y_bytes);
            }
            dw = dot_row(row_ptr(p.y_perm, r), p.y_perm.dtype, buf, H);
          }
          store_float(row_ptr(p.d_weights, t), DType::kF32, s, dw);
        }
        if (r < 0) continue;
        if (copy_as_is) {
          write_row(row_ptr(p.d_y_perm, r), g, out_bytes, stream);
          continue;
        }
        const float w =
            p.weights.data ? load_as_float(row_ptr(p.weights, t), p.weights.dtype, s) : 1.0f;
        scale_row(buf, w, H, buf + H, p.d_y_perm.dtype);
        write_row(row_ptr(p.d_y_perm, r), buf + H, out_bytes, stream);
      }
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < N; ++r) {
      if (!p.used[r]) write_row(row_ptr(p.d_y_perm, r), zeros(out_bytes), out_bytes, stream);
    }
    stream_fence();
  }
  return {};
}

Status sort_chunks_threaded(const SortChunksProblem& p) {
  const int64_t N = p.x.shape[0], H = p.x.shape[1];
  const int64_t C = static_cast<int64_t>(p.size.size());
  const size_t row_bytes = H * dtype_size(p.x.dtype);
  const bool stream = worth_streaming(p.out);
  const bool parallel = N * static_cast<int64_t>(row_bytes) >= kParallelBytes;
  // Chunk C is the rows past the chunks, copied in place.
  auto chunk = [&](int64_t c, int64_t* src, int64_t* dst, int64_t* n) {
    *src = c < C ? p.src[c] : p.chunk_rows;
    *dst = c < C ? p.dst[c] : p.chunk_rows;
    *n = c < C ? p.size[c] : N - p.chunk_rows;
  };
#pragma omp parallel if (parallel)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c <= C; ++c) {
      int64_t src, dst, n;
      chunk(c, &src, &dst, &n);
      for (int64_t i = 0; i < n; ++i) {
        write_row(row_ptr(p.out, dst + i), row_ptr(p.x, src + i), row_bytes, stream);
        if (p.probs.data) {
          store_float(p.out_probs.data, p.out_probs.dtype, (dst + i) * p.out_probs.stride[0],
                      load_as_float(p.probs.data, p.probs.dtype, (src + i) * p.probs.stride[0]));
        }
      }
    }
    stream_fence();
  }
  return {};
}

}  // namespace moekit::detail
