// Permutation between token order and expert-major order, and back (SPEC.md section 3).
//
// Notation: T tokens, H hidden size, E experts, k experts per token, S slots per token, N_out
// rows of the permuted buffer. Rows are f32 or bf16; sums run in f32.
//
// Routing comes in one of two forms, told apart by dtype:
//   topk_indices  [T, k] i32: slot s of token t goes to expert topk_indices[t, s] (S = k);
//   routing_map   [T, E] bool: slot s of token t is expert s, used where the map is 1 (S = E).
// Per-slot tensors (probs, merging probs and their gradients) are [T, S]: [T, k] beside
// topk_indices (e.g. topk_weights), [T, E] beside a routing map (e.g. the router's probs).
//
// permute returns the row map that every other call here takes: row_map [2, T, S] i32, where
// row_map[0, t, s] is the row of x_perm that holds slot s of token t (-1: not routed, or dropped
// by capacity) and row_map[1, t, s] its expert (-1: not routed).
//
// Every call validates all of its arguments, including index values, before it writes
// anything, and errors name the argument and its value. Row offsets are 64-bit throughout.
//
// Every call takes an execution context last (moekit/exec.h): on the CPU by default; with
// Exec::device = kCuda every tensor is device memory and the call is queued on the stream without
// waiting for the GPU. Shapes, dtypes and options are checked on the host as on the CPU; the
// values only the device holds (indices, the row map, chunk sizes) are not, and the kernels clamp
// them instead, never reading or writing out of bounds:
//   permute: out.x must have permute_max_rows rows (the worst case: the host cannot count the
//            routing), k from topk_indices or, with a routing map, options.k >= 1; an index
//            outside [0, E) is a slot not routed (row -1, expert -1), and a slot whose row would
//            fall past out.x (a map with more than k ones in a row) is dropped (row -1);
//   unpermute, permute_backward: a row outside [0, N) counts as -1;
//   unpermute_backward: a row named twice gets one of its slots' values;
//   sort_chunks_by_index: a negative size counts as 0, chunks are clipped to the N rows, and an
//            index outside [0, C) is an empty chunk.
// permute and unpermute_backward need a workspace there (permute_workspace_size). The results
// are the CPU's: the same rows in the same places, the same drops, and sums in the same order.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moekit/exec.h"
#include "moekit/status.h"
#include "moekit/view.h"

namespace moekit {

// Which tokens an expert over capacity keeps.
enum class DropPolicy {
  kProbs,     // the highest probs (ties: the earlier token, then the lower slot)
  kPosition,  // the earliest tokens (then the lower slot)
};

// kAuto takes the first that takes the call: the CUDA kernels on CUDA buffers, the threaded
// implementation on host buffers; kReference is the CPU's scalar one the tests compare with.
enum class PermuteImpl { kAuto, kCuda, kThreaded, kReference };
// "auto", "cuda", "threaded", "reference" ("unknown" outside the enum), as the errors say it.
const char* impl_name(PermuteImpl impl);

struct PermuteOptions {
  // Each expert's block of rows is padded with zero rows to a multiple of align_size, in
  // [1, 2^31 - 1].
  int64_t align_size = 1;
  // 0: dropless. > 0: each expert keeps at most capacity = ceil(T * k / E * capacity_factor)
  // of its routed slots (computed in double), chosen by drop_policy; the kept ones stay in token
  // order.
  double capacity_factor = 0.0;
  DropPolicy drop_policy = DropPolicy::kProbs;  // kProbs needs probs
  // With a capacity: every expert gets exactly capacity rows (rounded up to align_size),
  // padding rows zero with prob 0.
  bool pad_to_capacity = false;
  // Experts per token for the capacity formula. Taken from topk_indices in that form; needed
  // with a routing map and a capacity.
  int32_t k = 0;
  PermuteImpl impl = PermuteImpl::kAuto;
};

// The outputs of permute. x, tokens_per_expert and row_map are required.
struct PermuteOutputs {
  TensorView x;                  // [N_out, H] x's dtype; N_out >= the rows needed (see below)
  TensorView probs;              // [N_out] probs' dtype, or absent (needs probs)
  TensorView tokens_per_expert;  // [E] i32: rows of each expert's block, padding included
  TensorView row_map;            // [2, T, S] i32 (see the top of this file)
  TensorView pad_offsets;        // [E] i32, or absent: exclusive prefix sum of padding rows
};

// The most rows permute can need for any routing: the N_out that gives fixed shapes.
//   dropless: T * k, aligned: floor((T * k + E * (a - 1)) / a) * a;
//   capacity: the same with T * k replaced by min(T * k, E * capacity), and at most
//   E * round_up(capacity, a); pad_to_capacity: exactly E * round_up(capacity, a).
// Returns -1 for invalid sizes or options (permute names the problem), and when the bound exceeds
// the 2^31 - 1 rows permute can index (row_map is i32).
int64_t permute_max_rows(int64_t T, int64_t E, int32_t k, const PermuteOptions& options);

// Rows of x into expert-major order: expert e's block starts at the sum of the blocks before
// it; inside a block, kept slots in (token, slot) order, then zero padding rows. Rows of x_perm
// past the last block are zero (probs too).
//   x        [T, H] f32 | bf16, or absent together with out.x and out.probs (plan only: the
//            counts and the row map)
//   routing  [T, k] i32 topk_indices or [T, E] bool routing_map; E = out.tokens_per_expert's
//   probs    [T, S] f32 | bf16, or absent
// Error when out.x has fewer rows than the routing needs: never a write past the buffer.
Status permute(ConstTensorView x, ConstTensorView routing, ConstTensorView probs,
               const PermuteOptions& options, const PermuteOutputs& out, const Exec& exec = {});

// Combine: out[t] = sum over s with row_map[0, t, s] >= 0 of w[t, s] * y_perm[row_map[0, t, s]],
// summed in slot order in f32, w = merging_probs or 1. Padding rows are never read.
//   y_perm         [N_out, H] f32 | bf16
//   row_map        [2, T, S] i32 from permute
//   merging_probs  [T, S] f32 | bf16, or absent
//   out            [T, H] f32 | y_perm's dtype
Status unpermute(ConstTensorView y_perm, ConstTensorView row_map, ConstTensorView merging_probs,
                 TensorView out, PermuteImpl impl = PermuteImpl::kAuto, const Exec& exec = {});

// Gradient of permute: d_x[t] = sum of the rows of d_x_perm that hold token t (the k copies);
// d_probs[t, s] = d_probs_perm[row_map[0, t, s]], 0 where not routed or dropped.
//   d_x_perm      [N_out, H] f32 | bf16
//   d_probs_perm  [N_out] f32 | bf16, or absent (then d_probs must be absent)
//   d_x           [T, H] f32 | d_x_perm's dtype
//   d_probs       [T, S] f32 | d_probs_perm's dtype, or absent
Status permute_backward(ConstTensorView d_x_perm, ConstTensorView d_probs_perm,
                        ConstTensorView row_map, TensorView d_x, TensorView d_probs,
                        PermuteImpl impl = PermuteImpl::kAuto, const Exec& exec = {});

// Gradient of unpermute: d_y_perm[row_map[0, t, s]] = w[t, s] * d_out[t], every other row 0;
// d_merging_probs[t, s] = <y_perm[row_map[0, t, s]], d_out[t]>, 0 where not routed.
//   d_out            [T, H] f32 | bf16
//   y_perm           [N_out, H], needed only for d_merging_probs (else absent)
//   merging_probs    [T, S], or absent (w = 1)
//   d_y_perm         [N_out, H] f32 | d_out's dtype
//   d_merging_probs  [T, S] f32, or absent
// A row of d_y_perm named twice in row_map is an error (the map did not come from permute).
Status unpermute_backward(ConstTensorView d_out, ConstTensorView y_perm, ConstTensorView row_map,
                          ConstTensorView merging_probs, TensorView d_y_perm,
                          TensorView d_merging_probs, PermuteImpl impl = PermuteImpl::kAuto,
                          const Exec& exec = {});

// Chunk reordering after an all-to-all: the first sum(split_sizes) rows of x form C chunks of
// split_sizes[c] rows; out holds chunk sorted_index[0], then chunk sorted_index[1], ...; rows
// past the chunks are copied in place. inverse = true undoes it (it is also the gradient).
//   x             [N, H] f32 | bf16
//   split_sizes   [C] i32, >= 0, sum <= N
//   sorted_index  [C] i32, a permutation of [0, C)
//   out           [N, H] x's dtype
//   probs, out_probs: [N] f32 | bf16, moved alongside; both absent or both present
Status sort_chunks_by_index(ConstTensorView x, ConstTensorView split_sizes,
                            ConstTensorView sorted_index, bool inverse, TensorView out,
                            ConstTensorView probs = {}, TensorView out_probs = {},
                            PermuteImpl impl = PermuteImpl::kAuto, const Exec& exec = {});

// Bytes of workspace (Exec::workspace) any call of this file on `device` needs for T = tokens,
// S = slots per token (k, or E with a routing map), E = experts (for sort_chunks_by_index, its C
// chunks) and N = rows of the permuted buffer: on CUDA the sort of the slots by expert and the
// block layout (permute), the rows' owners (unpermute_backward) and the chunks' offsets
// (sort_chunks_by_index); 0 on the CPU. Negative sizes, or sizes past what a call accepts, give
// SIZE_MAX, which no workspace satisfies.
size_t permute_workspace_size(Device device, int64_t tokens, int64_t slots, int64_t experts,
                              int64_t rows);

}  // namespace moekit
