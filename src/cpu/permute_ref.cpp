// The scalar reference of the permutation ops: one expert at a time, one element at a time,
// written to be obviously what SPEC.md section 3 says. The tests hold the threaded
// implementation to it.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/convert.h"
#include "cpu/permute_kernels.h"

namespace moekit::detail {
namespace {

int32_t* row_map_at(const TensorView& m, int plane, int64_t t, int64_t s) {
  return static_cast<int32_t*>(m.data) + plane * m.stride[0] + t * m.stride[1] + s;
}
int32_t row_map_row(const ConstTensorView& m, int64_t t, int64_t s) {
  return static_cast<const int32_t*>(m.data)[t * m.stride[1] + s];
}

void zero_row(const TensorView& v, int64_t r, int64_t n) {
  for (int64_t h = 0; h < n; ++h) store_float(row_ptr(v, r), v.dtype, h, 0.0f);
}

}  // namespace

Status permute_ref(const PermuteProblem& p) {
  const PermuteOutputs& out = p.out;
  const int64_t N = out.x.data ? out.x.shape[0] : 0;
  // Slots not routed: row -1, expert from the routing (-1 where the map is 0).
  for (int64_t t = 0; t < p.T; ++t) {
    for (int64_t s = 0; s < p.S; ++s) {
      *row_map_at(out.row_map, 0, t, s) = -1;
      *row_map_at(out.row_map, 1, t, s) = slot_expert(p.routing, t, s);
    }
  }
  int64_t row = 0, padding = 0;
  for (int64_t e = 0; e < p.E; ++e) {
    struct Slot {
      int64_t t, s;
    };
    std::vector<Slot> slots;  // routed to e, in (token, slot) order
    for (int64_t t = 0; t < p.T; ++t) {
      for (int64_t s = 0; s < p.S; ++s) {
        if (slot_expert(p.routing, t, s) == e) slots.push_back({t, s});
      }
    }
    std::vector<Slot> kept = slots;
    if (p.capacity >= 0 && static_cast<int64_t>(slots.size()) > p.capacity) {
      if (p.options.drop_policy == DropPolicy::kProbs) {
        // Highest prob first (NaN last); stable, so equal probs keep (token, slot) order.
        auto prob = [&](const Slot& a) {
          const float v = load_as_float(row_ptr(p.probs, a.t), p.probs.dtype, a.s);
          return v == v ? v : -HUGE_VALF;
        };
        std::stable_sort(kept.begin(), kept.end(),
                         [&](const Slot& a, const Slot& b) { return prob(a) > prob(b); });
      }
      kept.resize(p.capacity);
      std::sort(kept.begin(), kept.end(),
                [](const Slot& a, const Slot& b) { return a.t != b.t ? a.t < b.t : a.s < b.s; });
    }
    const int64_t n_kept = static_cast<int64_t>(kept.size());
    const int64_t base = p.options.pad_to_capacity ? p.capacity : n_kept;
    const int64_t a = p.options.align_size;
    const int64_t block = (base + a - 1) / a * a;
    for (int64_t i = 0; i < n_kept; ++i) {
      const Slot& sl = kept[i];
      *row_map_at(out.row_map, 0, sl.t, sl.s) = static_cast<int32_t>(row + i);
      if (out.x.data) {
        for (int64_t h = 0; h < p.H; ++h) {
          store_float(row_ptr(out.x, row + i), out.x.dtype, h,
                      load_as_float(row_ptr(p.x, sl.t), p.x.dtype, h));
        }
      }
      if (out.probs.data) {
        store_float(out.probs.data, out.probs.dtype, (row + i) * out.probs.stride[0],
                    load_as_float(row_ptr(p.probs, sl.t), p.probs.dtype, sl.s));
      }
    }
    for (int64_t r = row + n_kept; r < row + block; ++r) {
      if (out.x.data) zero_row(out.x, r, p.H);
      if (out.probs.data) store_float(out.probs.data, out.probs.dtype, r * out.probs.stride[0], 0);
    }
    static_cast<int32_t*>(out.tokens_per_expert.data)[e * out.tokens_per_expert.stride[0]] =
        static_cast<int32_t>(block);
    if (out.pad_offsets.data) {
      static_cast<int32_t*>(out.pad_offsets.data)[e * out.pad_offsets.stride[0]] =
          static_cast<int32_t>(padding);
    }
    padding += block - n_kept;
    row += block;
  }
  for (int64_t r = row; r < N; ++r) {
    zero_row(out.x, r, p.H);
    if (out.probs.data) store_float(out.probs.data, out.probs.dtype, r * out.probs.stride[0], 0);
  }
  return {};
}

Status combine_ref(const CombineProblem& p) {
  const int64_t T = p.row_map.shape[1], S = p.row_map.shape[2], H = p.out.shape[1];
  std::vector<float> acc(H);
  for (int64_t t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t s = 0; s < S; ++s) {
      const int32_t r = row_map_row(p.row_map, t, s);
      if (p.slot_values.data) {
        const float v = r < 0 ? 0.0f
                              : load_as_float(p.row_values.data, p.row_values.dtype,
                                              r * p.row_values.stride[0]);
        store_float(row_ptr(p.slot_values, t), p.slot_values.dtype, s, v);
      }
      if (r < 0) continue;
      const float w =
          p.weights.data ? load_as_float(row_ptr(p.weights, t), p.weights.dtype, s) : 1.0f;
      for (int64_t h = 0; h < H; ++h)
        acc[h] += w * load_as_float(row_ptr(p.rows, r), p.rows.dtype, h);
    }
    for (int64_t h = 0; h < H; ++h) store_float(row_ptr(p.out, t), p.out.dtype, h, acc[h]);
  }
  return {};
}

Status scatter_ref(const ScatterProblem& p) {
  const int64_t T = p.row_map.shape[1], S = p.row_map.shape[2], H = p.d_out.shape[1];
  const int64_t N = p.d_y_perm.shape[0];
  for (int64_t r = 0; r < N; ++r) {
    if (!p.used[r]) zero_row(p.d_y_perm, r, H);
  }
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t s = 0; s < S; ++s) {
      const int32_t r = row_map_row(p.row_map, t, s);
      float dw = 0.0f;
      if (r >= 0) {
        const float w =
            p.weights.data ? load_as_float(row_ptr(p.weights, t), p.weights.dtype, s) : 1.0f;
        for (int64_t h = 0; h < H; ++h) {
          const float g = load_as_float(row_ptr(p.d_out, t), p.d_out.dtype, h);
          store_float(row_ptr(p.d_y_perm, r), p.d_y_perm.dtype, h, w * g);
          if (p.d_weights.data) dw += load_as_float(row_ptr(p.y_perm, r), p.y_perm.dtype, h) * g;
        }
      }
      if (p.d_weights.data) store_float(row_ptr(p.d_weights, t), DType::kF32, s, dw);
    }
  }
  return {};
}

Status sort_chunks_ref(const SortChunksProblem& p) {
  const int64_t N = p.x.shape[0], H = p.x.shape[1];
  auto copy = [&](int64_t from, int64_t to) {
    for (int64_t h = 0; h < H; ++h) {
      store_float(row_ptr(p.out, to), p.out.dtype, h,
                  load_as_float(row_ptr(p.x, from), p.x.dtype, h));
    }
    if (p.probs.data) {
      store_float(p.out_probs.data, p.out_probs.dtype, to * p.out_probs.stride[0],
                  load_as_float(p.probs.data, p.probs.dtype, from * p.probs.stride[0]));
    }
  };
  for (size_t c = 0; c < p.size.size(); ++c) {
    for (int64_t i = 0; i < p.size[c]; ++i) copy(p.src[c] + i, p.dst[c] + i);
  }
  for (int64_t r = p.chunk_rows; r < N; ++r) copy(r, r);
  return {};
}

}  // namespace moekit::detail
