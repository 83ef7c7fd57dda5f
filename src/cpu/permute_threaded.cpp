// The permutation ops on the CPU threads. permute: tokens split into one contiguous range per
// thread; a counting pass gives every (thread, expert) pair its first row, so that the rows come
// out in (token, slot) order inside each expert with no second sort, and each row is copied once,
// streamed when the output is larger than the caches. Combine and its gradient: one token per
// iteration, its k rows read side by side by the vector kernels of permute_simd.cpp.
#include <omp.h>

#include <algorithm>
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

// A token's routed slots, in slot order: their row in the permuted buffer, and their weight (1
// where there are no weights). One per thread, reused token after token.
struct TokenSlots {
  std::vector<int32_t> slot, row;
  std::vector<float> w;
  std::vector<const void*> addr;  // rows' addresses, filled by the caller where it needs them
  int64_t n = 0;

  void gather(const int32_t* slot_rows, int64_t S, const ConstTensorView& weights, int64_t t) {
    slot.resize(S);
    row.resize(S);
    w.resize(S);
    addr.resize(S);
    n = 0;
    for (int64_t s = 0; s < S; ++s) {
      if (slot_rows[s] < 0) continue;
      slot[n] = static_cast<int32_t>(s);
      row[n] = slot_rows[s];
      w[n] = weights.data ? load_as_float(row_ptr(weights, t), weights.dtype, s) : 1.0f;
      ++n;
    }
  }
  const void* const* addresses_in(const ConstTensorView& rows) {
    for (int64_t j = 0; j < n; ++j) addr[j] = row_ptr(rows, row[j]);
    return addr.data();
  }
};

Status combine_threaded(const CombineProblem& p) {
  const int64_t T = p.row_map.shape[1], S = p.row_map.shape[2], H = p.out.shape[1];
  const auto* rows = static_cast<const int32_t*>(p.row_map.data);
  const bool stream = worth_streaming(p.out);
  const size_t out_bytes = H * dtype_size(p.out.dtype);
  const bool parallel = T * S * H >= kParallelBytes;
#pragma omp parallel if (parallel)
  {
    thread_local TokenSlots slots;
    char* staged = reinterpret_cast<char*>(scratch_row<0>((out_bytes + 3) / 4));  // streamed out
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const int32_t* slot_rows = rows + t * p.row_map.stride[1];
      slots.gather(slot_rows, S, p.weights, t);
      if (p.slot_values.data) {
        for (int64_t s = 0; s < S; ++s) {
          const int32_t r = slot_rows[s];
          const float v = r < 0 ? 0.0f
                                : load_as_float(p.row_values.data, p.row_values.dtype,
                                                r * p.row_values.stride[0]);
          store_float(row_ptr(p.slot_values, t), p.slot_values.dtype, s, v);
        }
      }
      char* dst = stream ? staged : row_ptr(p.out, t);
      combine_rows(slots.addresses_in(p.rows), p.weights.data ? slots.w.data() : nullptr, slots.n,
                   p.rows.dtype, H, dst, p.out.dtype);
      if (stream) write_row(row_ptr(p.out, t), staged, out_bytes, true);
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
  const bool parallel = (T * S + N) * H >= kParallelBytes;
#pragma omp parallel if (parallel)
  {
    thread_local TokenSlots slots;
    thread_local std::vector<float> dots;
    float* buf = scratch_row<1>(H);  // d_out[t] in f32
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const char* g = row_ptr(p.d_out, t);
      slots.gather(rows + t * p.row_map.stride[1], S, p.weights, t);
      if (!copy_as_is || p.d_weights.data) load_row_as_float(g, p.d_out.dtype, H, buf);
      if (p.d_weights.data) {
        // d_weights[t, s] = <y_perm[row], d_out[t]>, 0 for the slots not routed.
        dots.resize(S);
        dot_rows(slots.addresses_in(p.y_perm), slots.n, p.y_perm.dtype, buf, H, dots.data());
        auto* dw = reinterpret_cast<float*>(row_ptr(p.d_weights, t));
        for (int64_t s = 0; s < S; ++s) dw[s] = 0.0f;
        for (int64_t j = 0; j < slots.n; ++j) dw[slots.slot[j]] = dots[j];
      }
      for (int64_t j = 0; j < slots.n; ++j) {
        char* dst = row_ptr(p.d_y_perm, slots.row[j]);
        if (copy_as_is) {
          write_row(dst, g, out_bytes, stream);
        } else {
          scale_row(buf, slots.w[j], H, dst, p.d_y_perm.dtype, stream);
        }
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
