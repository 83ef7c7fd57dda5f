// Internal: the two CPU implementations of the permutation problems (permute_problem.h): a
// scalar reference (permute_ref.cpp) and a threaded one (permute_threaded.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/convert.h"
#include "moekit/permute.h"
#include "permute_problem.h"

namespace moekit::detail {

// Expert of slot s of token t: topk_indices[t, s] (validated in [0, E)), or s where the routing
// map is 1; -1 where it is 0.
inline int32_t slot_expert(const ConstTensorView& routing, int64_t t, int64_t s) {
  const char* row = row_ptr(routing, t);
  if (routing.dtype == DType::kI32) return reinterpret_cast<const int32_t*>(row)[s];
  return reinterpret_cast<const uint8_t*>(row)[s] ? static_cast<int32_t>(s) : -1;
}

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
