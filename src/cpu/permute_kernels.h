// Internal: the permutation problems after validation (src/permute.cpp), and their two CPU
// implementations: a scalar reference (permute_ref.cpp) and a threaded one (permute_threaded.cpp).
// Absent optional tensors have data == nullptr here.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/convert.h"
#include "moekit/permute.h"

namespace moekit::detail {

// Expert of slot s of token t: topk_indices[t, s] (validated in [0, E)), or s where the routing
// map is 1; -1 where it is 0.
inline int32_t slot_expert(const ConstTensorView& routing, int64_t t, int64_t s) {
  const char* row = row_ptr(routing, t);
  if (routing.dtype == DType::kI32) return reinterpret_cast<const int32_t*>(row)[s];
  return reinterpret_cast<const uint8_t*>(row)[s] ? static_cast<int32_t>(s) : -1;
}

// Where each expert's block lies in x_perm, from the routed count per expert.
struct BlockLayout {
  std::vector<int64_t> kept;   // [E] slots kept (<= capacity)
  std::vector<int64_t> rows;   // [E] rows of the block: kept, or capacity, rounded up to align
  std::vector<int64_t> start;  // [E] first row of the block
  int64_t needed = 0;          // rows of all blocks
};
// capacity < 0: none.
BlockLayout block_layout(const std::vector<int64_t>& routed, int64_t capacity, int64_t align,
                         bool pad_to_capacity);

struct PermuteProblem {
  ConstTensorView x;        // [T, H], or absent (plan only)
  ConstTensorView routing;  // [T, k] i32 | [T, E] bool
  ConstTensorView probs;    // [T, S], or absent
  PermuteOptions options;
  PermuteOutputs out;  // out.x and out.probs absent in a plan-only call
  int64_t T = 0, E = 0, S = 0, H = 0;
  int64_t capacity = -1;  // -1: dropless
  BlockLayout layout;     // from the routed counts, checked against out.x
};

struct CombineProblem {
  ConstTensorView rows;        // [N, H]: y_perm (unpermute) or d_x_perm (permute's backward)
  ConstTensorView row_map;     // [2, T, S], every row index validated in [-1, N)
  ConstTensorView weights;     // [T, S], or absent (1)
  TensorView out;              // [T, H]
  ConstTensorView row_values;  // [N], or absent: gathered into slot_values (permute backward)
  TensorView slot_values;      // [T, S], or absent
};

struct ScatterProblem {
  ConstTensorView d_out;      // [T, H]
  ConstTensorView y_perm;     // [N, H], or absent
  ConstTensorView row_map;    // [2, T, S], row indices in [-1, N), each used at most once
  ConstTensorView weights;    // [T, S], or absent (1)
  TensorView d_y_perm;        // [N, H]
  TensorView d_weights;       // [T, S] f32, or absent (needs y_perm)
  std::vector<uint8_t> used;  // [N]: 1 where row_map names the row
};

struct SortChunksProblem {
  ConstTensorView x;  // [N, H]
  TensorView out;     // [N, H]
  ConstTensorView probs;
  TensorView out_probs;
  // Chunk c of the output takes rows [src[c], src[c] + size[c]) of x to [dst[c], ...);
  // rows past the chunks are copied in place.
  std::vector<int64_t> src, dst, size;
  int64_t chunk_rows = 0;  // sum of the sizes
};

Status permute_ref(const PermuteProblem& p);
Status combine_ref(const CombineProblem& p);
Status scatter_ref(const ScatterProblem& p);
Status sort_chunks_ref(const SortChunksProblem& p);

// out[0, H) = the sum over j < n, in order, of w[j] * rows[j][0, H) (w null: weights 1), in f32;
// rows f32 | bf16 (all of rows_t), out f32 | bf16 (rounded once). n = 0 gives zeros. Vector code
// (permute_simd.cpp) that reads the n rows side by side.
void combine_rows(const void* const* rows, const float* w, int64_t n, DType rows_t, int64_t H,
                  void* out, DType out_t);
// out[j] = <rows[j][0, H), g[0, H)> in f32 for j < n; rows f32 | bf16. The rows are read side by
// side, up to 8 at a time.
void dot_rows(const void* const* rows, int64_t n, DType rows_t, const float* g, int64_t H,
              float* out);
// out[0, H) = w * g[0, H), out f32 | bf16 (rounded as combine_rows rounds); stream: written with
// non-temporal stores where out is aligned for them (the caller fences).
void scale_row(const float* g, float w, int64_t H, void* out, DType out_t, bool stream);

Status permute_threaded(const PermuteProblem& p);
Status combine_threaded(const CombineProblem& p);
Status scatter_threaded(const ScatterProblem& p);
Status sort_chunks_threaded(const SortChunksProblem& p);

}  // namespace moekit::detail
