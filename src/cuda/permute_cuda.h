// Internal: the CUDA implementation of the permutation problems (permute_problem.h), in
// cuda/permute.cu. Included by permute.cpp (host compiler; its tables list them): no CUDA header.
//
// permute sorts the T * S slots by expert on the device (CUB's stable radix sort, so a block keeps
// its tokens in order; with the probs drop policy a first sort ranks each expert's slots by prob),
// lays the blocks out in one block-wide scan, then copies each token's row once to its k places.
// unpermute and permute_backward gather a token's rows in slot order (one warp per token, f32
// sums); unpermute_backward scatters them back and zeroes the rows no slot names;
// sort_chunks_by_index copies row by row from chunk offsets scanned on the device. Nothing is
// read on the host, so every call can be captured in a CUDA graph.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moekit/status.h"
#include "permute_problem.h"

namespace moekit::detail::cuda {

Status permute_cuda(const PermuteProblem& p);
Status combine_cuda(const CombineProblem& p);
Status scatter_cuda(const ScatterProblem& p);
Status sort_chunks_cuda(const SortChunksProblem& p);

// Workspace bytes for T * S slots of E experts (or E chunks) and N permuted rows: the largest
// any of the calls above needs.
size_t permute_workspace_bytes(int64_t tokens, int64_t slots, int64_t experts, int64_t rows);

}  // namespace moekit::detail::cuda
