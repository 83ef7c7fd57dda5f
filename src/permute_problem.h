// Internal: the permutation problems after validation (src/permute.cpp), as every implementation
// takes them: the CPU's (cpu/permute_kernels.h) and the CUDA one (cuda/permute_cuda.h). Each
// carries the call's execution context; its tensors live where exec.device says. What the entry
// points derive on the host from values in the tensors (the block layout, the rows used, the
// chunks' places) is there for host buffers only: on CUDA the kernels derive it on the device.
// Absent optional tensors have data == nullptr here.
#pragma once

#include <cstdint>
#include <vector>

#include "moekit/exec.h"
#include "moekit/permute.h"

namespace moekit::detail {

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
  BlockLayout layout;     // host buffers: from the routed counts, checked against out.x
  Exec exec;
};

struct CombineProblem {
  ConstTensorView rows;        // [N, H]: y_perm (unpermute) or d_x_perm (permute's backward)
  ConstTensorView row_map;     // [2, T, S], row indices in [-1, N) (host buffers: validated)
  ConstTensorView weights;     // [T, S], or absent (1)
  TensorView out;              // [T, H]
  ConstTensorView row_values;  // [N], or absent: gathered into slot_values (permute backward)
  TensorView slot_values;      // [T, S], or absent
  Exec exec;
};

struct ScatterProblem {
  ConstTensorView d_out;      // [T, H]
  ConstTensorView y_perm;     // [N, H], or absent
  ConstTensorView row_map;    // [2, T, S], row indices in [-1, N), each used at most once
  ConstTensorView weights;    // [T, S], or absent (1)
  TensorView d_y_perm;        // [N, H]
  TensorView d_weights;       // [T, S] f32, or absent (needs y_perm)
  std::vector<uint8_t> used;  // host buffers: [N], 1 where row_map names the row
  Exec exec;
};

struct SortChunksProblem {
  ConstTensorView x;  // [N, H]
  TensorView out;     // [N, H]
  ConstTensorView probs;
  TensorView out_probs;
  // Host buffers: chunk c of the output takes rows [src[c], src[c] + size[c]) of x to
  // [dst[c], ...); rows past the chunks are copied in place.
  std::vector<int64_t> src, dst, size;
  int64_t chunk_rows = 0;  // sum of the sizes
  // The chunks as given ([C] i32 each), which the CUDA kernels read on the device.
  ConstTensorView split_sizes, sorted_index;
  bool inverse = false;
  Exec exec;
};

}  // namespace moekit::detail
