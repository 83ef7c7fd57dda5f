// The permutation on CUDA (permute_cuda.h). What the CPU entry point works out on the host from
// the routing (the routed count per expert, the blocks' places), these kernels work out on the
// device, so that nothing waits for the host:
//
//   permute   1. keys: each slot (t, s), i = t * S + s, gets the key 2e (routed to expert e), or
//               2E (not routed, or an index outside [0, E)); with a capacity and the probs
//               policy, a first sort by (e, descending prob) ranks each expert's slots and the
//               ones past the capacity get 2e + 1;
//             2. a stable radix sort (CUB) of the slots by key: expert-major, (t, s) order inside,
//               the kept before the dropped;
//             3. the layout, one block: each expert's run of keys (binary searches), kept =
//               min(routed, capacity), rows = kept (or the capacity) rounded up to align, their
//               exclusive scan: tokens_per_expert, pad_offsets, the blocks' starts;
//             4. row_map from the sorted slots, then each token's row copied once to its rows
//               (one warp per token), and the rows no slot fills zeroed.
//   unpermute / permute_backward: one warp per token sums its slots' rows in slot order in f32.
//   unpermute_backward: one warp per token writes w * d_out[t] to each of its rows (and the dot
//             products for the probs' gradient); the rows no slot names are zeroed.
//   sort_chunks_by_index: one block scans the chunk sizes into offsets, then each output row is
//             copied from its place (a binary search over the chunks).
// Row copies move 16-byte words where every row is aligned for them, else narrower ones.
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <climits>
#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <initializer_list>

#include "cuda/launch.cuh"
#include "cuda/permute_cuda.h"
#include "cuda/rows.cuh"

namespace moekit::detail::cuda {
namespace {

constexpr int kWarps = 4;  // warps per block of the row kernels
constexpr int kThreads = kWarps * kWarp;
constexpr int kUnroll = 4;  // words a lane moves per step of a row copy
constexpr int kLayoutThreads = 1024;

// One warp per item (a token, a row) over the whole grid.
#define MOEKIT_FOR_EACH_WARP_ITEM(i, n)                                                      \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarp; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * kWarps)

unsigned warp_blocks(int64_t items) {
  return static_cast<unsigned>(std::clamp<int64_t>((items + kWarps - 1) / kWarps, 1, 1 << 20));
}
unsigned thread_blocks(int64_t items, int threads) {
  return static_cast<unsigned>(std::clamp<int64_t>((items + threads - 1) / threads, 1, 1 << 20));
}

// Bits to hold every value in [0, v].
int bits_for(uint64_t v) { return std::max(1, static_cast<int>(std::bit_width(v))); }

// A row_map [2, T, S] i32: plane 0 the rows, plane 1 the experts.
struct RowMap {
  char* p;
  int64_t ld;     // bytes between tokens
  int64_t plane;  // bytes between the planes
  __device__ int32_t* rows(int64_t t) const { return reinterpret_cast<int32_t*>(p + t * ld); }
  __device__ int32_t* experts(int64_t t) const {
    return reinterpret_cast<int32_t*>(p + plane + t * ld);
  }
};
template <bool kMutable>
RowMap row_map_of(const BasicView<kMutable>& v) {
  return RowMap{static_cast<char*>(const_cast<void*>(static_cast<const void*>(v.data))),
                v.stride[1] * 4, v.stride[0] * 4};
}

// --- permute ------------------------------------------------------------------------------------

// The device's arrays for one permute call, carved from the workspace.
struct PermuteWork {
  uint64_t *keys64_in, *keys64_out;  // the probs policy's first sort
  uint32_t *keys_in, *keys_out;
  int32_t *items_in, *items_out;  // slot indices t * S + s
  int64_t *seg, *kept, *start;    // [E], [E], [E + 1]: run of the sorted keys, kept, block start
  int64_t* seg64;                 // [E + 1]: runs of the first sort
  void* sort_temp;
  size_t sort_temp_bytes;
};

// CUB's temporary storage for a stable sort of n (key, item) pairs over `bits` bits.
template <class Key>
size_t sort_temp_bytes(int64_t n, int bits) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const Key*>(nullptr),
                                  static_cast<Key*>(nullptr), static_cast<const int32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr), static_cast<int>(n), 0, bits);
  return bytes;
}

// With a null base only the end (the bytes) means anything.
PermuteWork carve_permute(void* base, int64_t n, int64_t E, uintptr_t* end) {
  Carve c(base);
  PermuteWork w;
  w.keys64_in = c.take<uint64_t>(n);
  w.keys64_out = c.take<uint64_t>(n);
  w.keys_in = c.take<uint32_t>(n);
  w.keys_out = c.take<uint32_t>(n);
  w.items_in = c.take<int32_t>(n);
  w.items_out = c.take<int32_t>(n);
  w.seg = c.take<int64_t>(E);
  w.kept = c.take<int64_t>(E);
  w.start = c.take<int64_t>(E + 1);
  w.seg64 = c.take<int64_t>(E + 1);
  w.sort_temp_bytes = std::max(sort_temp_bytes<uint64_t>(n, 32 + bits_for(E)),
                               sort_temp_bytes<uint32_t>(n, bits_for(2 * E)));
  w.sort_temp = c.take<char>(static_cast<int64_t>(w.sort_temp_bytes));
  *end = c.position();
  return w;
}

struct KeyArgs {
  Mat routing, probs;
  RowMap row_map;
  int64_t T, S, E;
  bool by_probs;  // a capacity with the probs policy: 64-bit keys (e, descending prob)
};

// A prob as a key whose ascending order is the probs policy's: larger first, NaN as -inf, -0 as
// +0 (they compare equal on the CPU, so the stable sort keeps their (t, s) order).
__device__ uint32_t descending_key(float v) {
  if (isnan(v)) v = -INFINITY;
  if (v == 0.0f) v = 0.0f;
  const uint32_t u = __float_as_uint(v);
  const uint32_t ascending = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ~ascending;
}

// Step 1: every slot's expert (row_map's plane 1) and key; the items in order.
__global__ void slot_keys_kernel(KeyArgs a, PermuteWork w) {
  const int64_t n = a.T * a.S;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / a.S, s = i % a.S;
    int64_t e;
    if (a.routing.t == DType::kI32) {
      e = a.routing.row<const int32_t>(t)[s];
      if (e < 0 || e >= a.E) e = -1;
    } else {
      e = a.routing.row<const uint8_t>(t)[s] ? s : -1;
    }
    a.row_map.experts(t)[s] = static_cast<int32_t>(e);
    const uint64_t expert = e < 0 ? a.E : e;
    if (a.by_probs) {
      const uint32_t low = e < 0 ? 0 : descending_key(load_float(a.probs, t, s));
      w.keys64_in[i] = (expert << 32) | low;
    } else {
      w.keys_in[i] = static_cast<uint32_t>(2 * expert);
    }
    w.items_in[i] = static_cast<int32_t>(i);
  }
}

// The first position of sorted keys[0, n) not below v.
template <class Key>
__device__ int64_t lower_bound(const Key* keys, int64_t n, Key v) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] < v) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The probs policy, between the sorts: each expert's run of the first sort, for e in [0, E].
__global__ void runs64_kernel(PermuteWork w, int64_t n, int64_t E) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e <= E;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    w.seg64[e] = lower_bound(w.keys64_out, n, static_cast<uint64_t>(e) << 32);
  }
}

// The probs policy: a slot ranked past the capacity among its expert's gets the key 2e + 1.
__global__ void drop_keys_kernel(PermuteWork w, int64_t n, int64_t E, int64_t capacity) {
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < n;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = static_cast<int64_t>(w.keys64_out[p] >> 32);
    const int32_t item = w.items_out[p];
    w.keys_in[item] = e >= E ? static_cast<uint32_t>(2 * E)
                             : static_cast<uint32_t>(2 * e + (p - w.seg64[e] >= capacity));
  }
}

struct LayoutArgs {
  Mat tokens_per_expert, pad_offsets;  // [E] i32 each (vectors)
  int64_t n, E, capacity, align;       // capacity < 0: none
  bool pad_to_capacity;
};

// Step 3, one block: each expert's run of the sorted keys, what it keeps, its rows and where its
// block starts, over the experts in chunks of the block with a running carry.
__global__ void __launch_bounds__(kLayoutThreads) layout_kernel(LayoutArgs a, PermuteWork w) {
  using Scan = cub::BlockScan<int64_t, kLayoutThreads>;
  __shared__ typename Scan::TempStorage scan;
  int64_t carry = 0, carry_pad = 0;
  for (int64_t base = 0; base < a.E; base += kLayoutThreads) {
    const int64_t e = base + threadIdx.x;
    int64_t rows = 0, kept = 0, seg = 0;
    if (e < a.E) {
      seg = lower_bound(w.keys_out, a.n, static_cast<uint32_t>(2 * e));
      const int64_t routed = lower_bound(w.keys_out, a.n, static_cast<uint32_t>(2 * e + 2)) - seg;
      kept = a.capacity < 0 || routed < a.capacity ? routed : a.capacity;
      const int64_t base_rows = a.pad_to_capacity ? a.capacity : kept;
      rows = (base_rows + a.align - 1) / a.align * a.align;
    }
    int64_t start, total, pad_start, pad_total;
    Scan(scan).ExclusiveSum(rows, start, total);
    __syncthreads();
    Scan(scan).ExclusiveSum(rows - kept, pad_start, pad_total);
    __syncthreads();
    if (e < a.E) {
      w.seg[e] = seg;
      w.kept[e] = kept;
      w.start[e] = carry + start;
      store_int(a.tokens_per_expert, e, rows);
      if (a.pad_offsets.present()) store_int(a.pad_offsets, e, carry_pad + pad_start);
    }
    carry += total;
    carry_pad += pad_total;
  }
  if (threadIdx.x == 0) w.start[a.E] = carry;
}

struct PlaceArgs {
  RowMap row_map;
  int64_t n, S, E;
  int64_t rows_cap;  // rows of out.x (plan only: i32's): a row past them is dropped
};

// Step 4a: row_map's plane 0 from the sorted slots.
__global__ void place_kernel(PlaceArgs a, PermuteWork w) {
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < a.n;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t item = w.items_out[p];
    const int64_t e = w.keys_out[p] >> 1;
    int64_t row = -1;
    if (e < a.E) {
      const int64_t rank = p - w.seg[e];
      if (rank < w.kept[e]) row = w.start[e] + rank;
      if (row >= a.rows_cap) row = -1;
    }
    a.row_map.rows(item / a.S)[item % a.S] = static_cast<int32_t>(row);
  }
}

struct GatherArgs {
  Mat x, out, probs, out_probs;
  RowMap row_map;
  int64_t T, S, row_bytes;
};

// Step 4b: token t's row, read once, written to each of its rows; its probs beside them.
template <class W>
__global__ void __launch_bounds__(kThreads) gather_kernel(GatherArgs a) {
  const int lane = threadIdx.x % kWarp;
  const int64_t words = a.row_bytes / static_cast<int64_t>(sizeof(W));
  MOEKIT_FOR_EACH_WARP_ITEM(t, a.T) {
    const int32_t* rows = a.row_map.rows(t);
    const W* src = a.x.row<const W>(t);
    for (int64_t c = 0; c < words; c += kWarp * kUnroll) {
      W v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = c + lane + kWarp * u;
        if (i < words) v[u] = src[i];
      }
      for (int64_t s = 0; s < a.S; ++s) {
        const int32_t r = rows[s];
        if (r < 0) continue;
        W* dst = a.out.row<W>(r);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t i = c + lane + kWarp * u;
          if (i < words) dst[i] = v[u];
        }
      }
    }
    if (!a.out_probs.present()) continue;
    for (int64_t s = lane; s < a.S; s += kWarp) {
      if (rows[s] >= 0) copy_elem(a.probs, t, s, a.out_probs, rows[s], 0);
    }
  }
}

struct ZeroArgs {
  Mat out, out_probs;
  int64_t rows, E, row_bytes;
};

// Step 4c: the rows no slot fills (a block's padding, the rows past the blocks) are zero.
template <class W>
__global__ void __launch_bounds__(kThreads) zero_unfilled_kernel(ZeroArgs a, PermuteWork w) {
  const int lane = threadIdx.x % kWarp;
  const int64_t words = a.row_bytes / static_cast<int64_t>(sizeof(W));
  MOEKIT_FOR_EACH_WARP_ITEM(r, a.rows) {
    bool filled = false;
    if (r < w.start[a.E]) {
      // The last block starting at or before r holds it (empty blocks start where the next
      // one does).
      int64_t lo = 0, hi = a.E;
      while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (w.start[mid] <= r) {
          lo = mid;
        } else {
          hi = mid;
        }
      }
      filled = r - w.start[lo] < w.kept[lo];
    }
    if (filled) continue;
    W* dst = a.out.row<W>(r);
    for (int64_t i = lane; i < words; i += kWarp) dst[i] = W{};
    if (lane == 0 && a.out_probs.present()) store_float(a.out_probs, r, 0, 0.0f);
  }
}

// --- unpermute, permute_backward ----------------------------------------------------------------

struct CombineArgs {
  Mat rows, weights, out, row_values, slot_values;
  RowMap row_map;
  int64_t T, S, N, H;
};

// out[t] = sum over s of w[t, s] * rows[row_map[0, t, s]], in slot order, in f32.
template <int V>
__global__ void __launch_bounds__(kThreads) combine_kernel(CombineArgs a) {
  const int lane = threadIdx.x % kWarp;
  MOEKIT_FOR_EACH_WARP_ITEM(t, a.T) {
    const int32_t* slots = a.row_map.rows(t);
    for (int64_t h = static_cast<int64_t>(lane) * V; h < a.H; h += kWarp * V) {
      float acc[V];
#pragma unroll
      for (int i = 0; i < V; ++i) acc[i] = 0.0f;
#pragma unroll 4
      for (int64_t s = 0; s < a.S; ++s) {
        const int32_t r = slots[s];
        if (r < 0 || r >= a.N) continue;
        const float w = a.weights.present() ? load_float(a.weights, t, s) : 1.0f;
        float v[V];
        load_elems(a.rows.row(r), a.rows.t, h, v);
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] += w * v[i];
      }
      store_elems(a.out.row(t), a.out.t, h, acc);
    }
    if (!a.slot_values.present()) continue;
    for (int64_t s = lane; s < a.S; s += kWarp) {
      const int32_t r = slots[s];
      store_float(a.slot_values, t, s, r >= 0 && r < a.N ? load_float(a.row_values, r, 0) : 0.0f);
    }
  }
}

// --- unpermute_backward -------------------------------------------------------------------------

struct ScatterArgs {
  Mat d_out, y_perm, weights, d_y_perm, d_weights;
  RowMap row_map;
  int64_t T, S, N, H;
  uint8_t* named;  // [N]: 1 where a slot names the row
};

__global__ void mark_named_kernel(ScatterArgs a) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < a.T * a.S;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t r = a.row_map.rows(i / a.S)[i % a.S];
    if (r >= 0 && r < a.N) a.named[r] = 1;
  }
}

template <class W>
__global__ void __launch_bounds__(kThreads) zero_unnamed_kernel(ScatterArgs a, int64_t row_bytes) {
  const int lane = threadIdx.x % kWarp;
  const int64_t words = row_bytes / static_cast<int64_t>(sizeof(W));
  MOEKIT_FOR_EACH_WARP_ITEM(r, a.N) {
    if (a.named[r]) continue;
    W* dst = a.d_y_perm.row<W>(r);
    for (int64_t i = lane; i < words; i += kWarp) dst[i] = W{};
  }
}

// d_y_perm[row] = w[t, s] * d_out[t] for each slot s of t; d_weights[t, s] = <y_perm[row],
// d_out[t]> (0 where not routed). d_out[t] is read once from memory (again from the cache).
template <int V>
__global__ void __launch_bounds__(kThreads) scatter_kernel(ScatterArgs a) {
  const int lane = threadIdx.x % kWarp;
  MOEKIT_FOR_EACH_WARP_ITEM(t, a.T) {
    const int32_t* slots = a.row_map.rows(t);
    for (int64_t s = 0; s < a.S; ++s) {
      const int32_t r = slots[s];
      if (r < 0 || r >= a.N) {
        if (lane == 0 && a.d_weights.present()) store_float(a.d_weights, t, s, 0.0f);
        continue;
      }
      const float w = a.weights.present() ? load_float(a.weights, t, s) : 1.0f;
      float dot = 0.0f;
      for (int64_t h = static_cast<int64_t>(lane) * V; h < a.H; h += kWarp * V) {
        float g[V], d[V];
        load_elems(a.d_out.row(t), a.d_out.t, h, g);
#pragma unroll
        for (int i = 0; i < V; ++i) d[i] = w * g[i];
        store_elems(a.d_y_perm.row(r), a.d_y_perm.t, h, d);
        if (a.d_weights.present()) {
          float y[V];
          load_elems(a.y_perm.row(r), a.y_perm.t, h, y);
#pragma unroll
          for (int i = 0; i < V; ++i) dot += y[i] * g[i];
        }
      }
      if (a.d_weights.present()) {
        dot = warp_sum(dot);
        if (lane == 0) store_float(a.d_weights, t, s, dot);
      }
    }
  }
}

// --- sort_chunks_by_index -----------------------------------------------------------------------

// The chunks, planned on the device. in_off[c]: where input chunk c starts; out_off[j]: where
// sorted position j starts; pos[c]: the sorted position of input chunk c (-1: none). Then, in the
// order of the output's rows, chunk d covers output rows [dst[d], dst[d] + len[d]) and takes them
// from input rows [src[d], ...); dst ascends.
struct ChunkWork {
  int64_t *in_off, *out_off, *dst, *src, *len;
  int32_t* pos;
};

ChunkWork carve_chunks(void* base, int64_t C, uintptr_t* end) {
  Carve c(base);
  ChunkWork w;
  w.in_off = c.take<int64_t>(C);
  w.out_off = c.take<int64_t>(C);
  w.dst = c.take<int64_t>(C);
  w.src = c.take<int64_t>(C);
  w.len = c.take<int64_t>(C);
  w.pos = c.take<int32_t>(C);
  *end = c.position();
  return w;
}

struct ChunkArgs {
  Mat sizes, index;  // [C] i32 vectors
  int64_t C;
  bool inverse;
};

// One block. A negative size counts as 0; an index outside [0, C) is an empty chunk; of a
// repeated index, one place holds the chunk (the inverse) or both do (the forward).
__global__ void __launch_bounds__(kLayoutThreads) chunk_plan_kernel(ChunkArgs a, ChunkWork w) {
  using Scan = cub::BlockScan<int64_t, kLayoutThreads>;
  __shared__ typename Scan::TempStorage scan;
  auto size_of = [&](int64_t c) -> int64_t {
    if (c < 0 || c >= a.C) return 0;
    const int32_t v = load_int(a.sizes, c);
    return v < 0 ? 0 : v;
  };
  auto index_of = [&](int64_t j) -> int64_t {
    const int32_t c = load_int(a.index, j);
    return c >= 0 && c < a.C ? c : -1;
  };
  int64_t carry = 0, sorted_carry = 0;
  for (int64_t base = 0; base < a.C; base += kLayoutThreads) {
    const int64_t i = base + threadIdx.x;
    const bool in = i < a.C;
    int64_t at, total, sorted_at, sorted_total;
    Scan(scan).ExclusiveSum(in ? size_of(i) : 0, at, total);
    __syncthreads();
    Scan(scan).ExclusiveSum(in ? size_of(index_of(i)) : 0, sorted_at, sorted_total);
    __syncthreads();
    if (in) {
      w.in_off[i] = carry + at;
      w.out_off[i] = sorted_carry + sorted_at;
      w.pos[i] = -1;
    }
    carry += total;
    sorted_carry += sorted_total;
  }
  __syncthreads();
  for (int64_t j = threadIdx.x; j < a.C; j += blockDim.x) {
    const int64_t c = index_of(j);
    if (c >= 0) w.pos[c] = static_cast<int32_t>(j);
  }
  __syncthreads();
  for (int64_t d = threadIdx.x; d < a.C; d += blockDim.x) {
    if (!a.inverse) {  // output chunk d is input chunk index[d]
      const int64_t c = index_of(d);
      w.dst[d] = w.out_off[d];
      w.src[d] = c >= 0 ? w.in_off[c] : 0;
      w.len[d] = size_of(c);
    } else {  // output chunk d (input order) comes back from its sorted place
      const int64_t j = w.pos[d];
      w.dst[d] = w.in_off[d];
      w.src[d] = j >= 0 ? w.out_off[j] : 0;
      w.len[d] = j >= 0 ? size_of(d) : 0;
    }
  }
}

struct ChunkCopyArgs {
  Mat x, out, probs, out_probs;
  int64_t N, C, row_bytes;
};

// Output row r from its chunk's place; a row no chunk covers (past the chunks, or of a chunk
// missing from sorted_index) from the same row of x; a source past N likewise.
template <class W>
__global__ void __launch_bounds__(kThreads) chunk_copy_kernel(ChunkCopyArgs a, ChunkWork w) {
  const int lane = threadIdx.x % kWarp;
  const int64_t words = a.row_bytes / static_cast<int64_t>(sizeof(W));
  MOEKIT_FOR_EACH_WARP_ITEM(r, a.N) {
    int64_t lo = 0, hi = a.C;  // the last chunk with dst <= r: lo, once hi - lo == 1
    int64_t from = r;
    if (a.C > 0 && w.dst[0] <= r) {
      while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (w.dst[mid] <= r) {
          lo = mid;
        } else {
          hi = mid;
        }
      }
      if (r - w.dst[lo] < w.len[lo]) from = w.src[lo] + (r - w.dst[lo]);
      if (from >= a.N) from = r;
    }
    const W* src = a.x.row<const W>(from);
    W* dst = a.out.row<W>(r);
    for (int64_t i = lane; i < words; i += kWarp) dst[i] = src[i];
    if (lane == 0 && a.out_probs.present()) {
      copy_elem(a.probs, from, 0, a.out_probs, r, 0);
    }
  }
}

constexpr const char* kOp = "permute (CUDA)";

}  // namespace

size_t permute_workspace_bytes(int64_t tokens, int64_t slots, int64_t experts, int64_t rows) {
  int64_t n = 0;
  if (__builtin_mul_overflow(tokens, slots, &n) || n > INT32_MAX || experts > INT32_MAX ||
      rows > INT64_MAX / 2) {
    return SIZE_MAX;
  }
  uintptr_t permute = 0, chunks = 0;
  carve_permute(nullptr, n, experts, &permute);
  carve_chunks(nullptr, experts, &chunks);
  const size_t named = align_up(static_cast<size_t>(rows));
  return std::max({static_cast<size_t>(permute), static_cast<size_t>(chunks), named});
}

Status permute_cuda(const PermuteProblem& p) {
  const char* op = "permute";
  const Exec& exec = p.exec;
  const int64_t n = p.T * p.S, E = p.E;
  uintptr_t need = 0;
  carve_permute(nullptr, n, E, &need);
  MOEKIT_RETURN_IF_ERROR(
      check_workspace(op, exec, need, "permute_workspace_size(Device::kCuda, T, S, E, N)"));
  const PermuteWork w = carve_permute(exec.workspace, n, E, &need);
  const PermuteOutputs& out = p.out;
  const RowMap row_map = row_map_of(out.row_map);
  const bool by_probs =
      p.capacity >= 0 && p.options.drop_policy == DropPolicy::kProbs && p.probs.data != nullptr;
  cudaStream_t stream = exec.stream;

  // 1-2: keys, and the slots sorted by them.
  if (n > 0) {
    const KeyArgs keys{Mat(p.routing), Mat(p.probs), row_map, p.T, p.S, E, by_probs};
    slot_keys_kernel<<<thread_blocks(n, 256), 256, 0, stream>>>(keys, w);
    MOEKIT_RETURN_IF_ERROR(launch_status(kOp, "the slot keys"));
    size_t temp = w.sort_temp_bytes;
    if (by_probs) {
      MOEKIT_RETURN_IF_ERROR(
          cuda_status(kOp, "the sort by prob",
                      cub::DeviceRadixSort::SortPairs(w.sort_temp, temp, w.keys64_in, w.keys64_out,
                                                      w.items_in, w.items_out, static_cast<int>(n),
                                                      0, 32 + bits_for(E), stream)));
      runs64_kernel<<<thread_blocks(E + 1, 256), 256, 0, stream>>>(w, n, E);
      drop_keys_kernel<<<thread_blocks(n, 256), 256, 0, stream>>>(w, n, E, p.capacity);
      MOEKIT_RETURN_IF_ERROR(launch_status(kOp, "the drops by prob"));
      temp = w.sort_temp_bytes;
    }
    MOEKIT_RETURN_IF_ERROR(
        cuda_status(kOp, "the sort by expert",
                    cub::DeviceRadixSort::SortPairs(w.sort_temp, temp, w.keys_in, w.keys_out,
                                                    w.items_in, w.items_out, static_cast<int>(n), 0,
                                                    bits_for(2 * E), stream)));
  }
  // 3: the layout.
  const LayoutArgs layout{Mat(out.tokens_per_expert), Mat(out.pad_offsets),     n, E, p.capacity,
                          p.options.align_size,       p.options.pad_to_capacity};
  layout_kernel<<<1, kLayoutThreads, 0, stream>>>(layout, w);
  MOEKIT_RETURN_IF_ERROR(launch_status(kOp, "the layout"));
  // 4: the rows.
  const bool with_rows = out.x.data != nullptr;
  const int64_t rows = with_rows ? out.x.shape[0] : 0;
  if (n > 0) {
    const PlaceArgs place{row_map, n, p.S, E, with_rows ? rows : INT32_MAX};
    place_kernel<<<thread_blocks(n, 256), 256, 0, stream>>>(place, w);
    MOEKIT_RETURN_IF_ERROR(launch_status(kOp, "the row map"));
  }
  if (!with_rows || rows == 0) return {};
  const Mat x(p.x), x_out(out.x);
  const int64_t row_bytes = p.H * static_cast<int64_t>(dtype_size(p.x.dtype));
  if (p.T > 0 && row_bytes > 0) {
    const GatherArgs gather{x, x_out, Mat(p.probs), Mat(out.probs), row_map, p.T, p.S, row_bytes};
    with_word({x, x_out}, row_bytes, [&](auto word) {
      gather_kernel<decltype(word)><<<warp_blocks(p.T), kThreads, 0, stream>>>(gather);
    });
    MOEKIT_RETURN_IF_ERROR(launch_status(kOp, "the row copies"));
  }
  const ZeroArgs zero{x_out, Mat(out.probs), rows, E, row_bytes};
  with_word({x_out}, row_bytes, [&](auto word) {
    zero_unfilled_kernel<decltype(word)><<<warp_blocks(rows), kThreads, 0, stream>>>(zero, w);
  });
  return launch_status(kOp, "the zero rows");
}

Status combine_cuda(const CombineProblem& p) {
  const int64_t T = p.row_map.shape[1], S = p.row_map.shape[2], H = p.out.shape[1];
  if (T == 0) return {};
  const CombineArgs a{Mat(p.rows),
                      Mat(p.weights),
                      Mat(p.out),
                      Mat(p.row_values),
                      Mat(p.slot_values),
                      row_map_of(p.row_map),
                      T,
                      S,
                      p.rows.shape[0],
                      H};
  const unsigned blocks = warp_blocks(T);
  if (rows_aligned({a.rows, a.out}, H)) {
    combine_kernel<8><<<blocks, kThreads, 0, p.exec.stream>>>(a);
  } else {
    combine_kernel<1><<<blocks, kThreads, 0, p.exec.stream>>>(a);
  }
  return launch_status(p.slot_values.data ? "permute_backward" : "unpermute", "the kernel");
}

Status scatter_cuda(const ScatterProblem& p) {
  const char* op = "unpermute_backward";
  const Exec& exec = p.exec;
  const int64_t T = p.row_map.shape[1], S = p.row_map.shape[2];
  const int64_t N = p.d_y_perm.shape[0], H = p.d_y_perm.shape[1];
  MOEKIT_RETURN_IF_ERROR(check_workspace(op, exec, align_up(static_cast<size_t>(N)),
                                         "permute_workspace_size(Device::kCuda, T, S, E, N)"));
  if (N == 0 && T == 0) return {};
  const ScatterArgs a{Mat(p.d_out),
                      Mat(p.y_perm),
                      Mat(p.weights),
                      Mat(p.d_y_perm),
                      Mat(p.d_weights),
                      row_map_of(p.row_map),
                      T,
                      S,
                      N,
                      H,
                      static_cast<uint8_t*>(exec.workspace)};
  cudaStream_t stream = exec.stream;
  if (N > 0) {
    MOEKIT_RETURN_IF_ERROR(
        cuda_status(op, "cudaMemsetAsync", cudaMemsetAsync(a.named, 0, N, stream)));
  }
  if (T * S > 0) mark_named_kernel<<<thread_blocks(T * S, 256), 256, 0, stream>>>(a);
  const int64_t row_bytes = H * static_cast<int64_t>(dtype_size(p.d_y_perm.dtype));
  if (N > 0 && row_bytes > 0) {
    with_word({a.d_y_perm}, row_bytes, [&](auto word) {
      zero_unnamed_kernel<decltype(word)><<<warp_blocks(N), kThreads, 0, stream>>>(a, row_bytes);
    });
  }
  if (T > 0) {
    if (rows_aligned({a.d_out, a.y_perm, a.d_y_perm}, H)) {
      scatter_kernel<8><<<warp_blocks(T), kThreads, 0, stream>>>(a);
    } else {
      scatter_kernel<1><<<warp_blocks(T), kThreads, 0, stream>>>(a);
    }
  }
  return launch_status(op, "the kernels");
}

Status sort_chunks_cuda(const SortChunksProblem& p) {
  const char* op = "sort_chunks_by_index";
  const Exec& exec = p.exec;
  const int64_t C = p.split_sizes.shape[0], N = p.x.shape[0];
  uintptr_t need = 0;
  carve_chunks(nullptr, C, &need);
  MOEKIT_RETURN_IF_ERROR(
      check_workspace(op, exec, need, "permute_workspace_size(Device::kCuda, T, S, C, N)"));
  if (N == 0) return {};
  const ChunkWork w = carve_chunks(exec.workspace, C, &need);
  cudaStream_t stream = exec.stream;
  if (C > 0) {
    chunk_plan_kernel<<<1, kLayoutThreads, 0, stream>>>(
        ChunkArgs{Mat(p.split_sizes), Mat(p.sorted_index), C, p.inverse}, w);
    MOEKIT_RETURN_IF_ERROR(launch_status(op, "the chunk plan"));
  }
  const ChunkCopyArgs a{Mat(p.x),
                        Mat(p.out),
                        Mat(p.probs),
                        Mat(p.out_probs),
                        N,
                        C,
                        p.x.shape[1] * static_cast<int64_t>(dtype_size(p.x.dtype))};
  with_word({a.x, a.out}, a.row_bytes, [&](auto word) {
    chunk_copy_kernel<decltype(word)><<<warp_blocks(N), kThreads, 0, stream>>>(a, w);
  });
  return launch_status(op, "the row copies");
}

}  // namespace moekit::detail::cuda
