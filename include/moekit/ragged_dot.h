// ragged_dot: a grouped matrix multiply whose rows are grouped by expert, with group_offset so
// that a shard computes only the groups of the experts it holds (SPEC.md section 1).
//
// Notation: m rows, K contraction size, n output columns, G groups in group_sizes, E_loc groups
// held locally (rhs.shape[0]). start[j] = sum(group_sizes[:j]). Row r belongs to group j when
// start[j] <= r < start[j+1]. Groups group_offset .. group_offset+E_loc-1 are local; local group
// j multiplies by rhs[j - group_offset]. Every other row (non-local groups, and rows at or past
// sum(group_sizes)) is written as exactly 0 and never read, so NaN there cannot leak out.
//
// Dtypes: lhs and rhs both f32 or both bf16; out f32 or the input dtype. Products accumulate in
// f32 whatever the storage type. group_sizes live on the host for the CPU backend.
//
// Every call validates all of its arguments before it writes anything. Errors name the argument
// and its value: a negative group size, sizes summing past m, group_offset outside
// [0, G - E_loc], shapes or dtypes that do not match, a null pointer for a non-empty tensor, an
// innermost stride other than 1.
#pragma once

#include <cstdint>
#include <span>

#include "moekit/status.h"
#include "moekit/view.h"

namespace moekit {

// Which implementation runs. kAuto takes the fastest one that supports the call; kReference is
// the scalar reference the tests compare against (slow; for checking only).
enum class RaggedDotImpl { kAuto, kOneDnn, kReference };

struct RaggedDotOptions {
  int32_t group_offset = 0;     // first local group; in [0, G - E_loc]
  bool rhs_transposed = false;  // rhs is [E_loc, n, K] instead of [E_loc, K, n]
  // Add into the existing output instead of overwriting it. Forward and input gradient: rows
  // outside the local groups are left untouched (so shards can sum into one buffer). Weight
  // gradient: d_rhs += the new gradient; empty groups left untouched.
  bool accumulate = false;
  RaggedDotImpl impl = RaggedDotImpl::kAuto;
};

// Forward.
//   lhs          [m, K]                                  f32 | bf16
//   rhs          [E_loc, K, n]  ([E_loc, n, K] if rhs_transposed), same dtype as lhs
//   group_sizes  [G] int32, G >= E_loc, each >= 0, sum <= m (host memory)
//   out          [m, n]                                  f32 | lhs dtype
// With group_offset = 0 and E_loc = G this is jax.lax.ragged_dot(lhs, rhs, group_sizes).
Status ragged_dot(ConstTensorView lhs, ConstTensorView rhs, std::span<const int32_t> group_sizes,
                  TensorView out, const RaggedDotOptions& options = {});

// Input gradient: d_lhs = ragged_dot(d_out, rhs^T) with the same groups and offset; 0 on
// non-local rows (untouched with accumulate).
//   d_out        [m, n]                                  f32 | bf16
//   rhs          as in the forward (options.rhs_transposed says its layout), dtype of d_out
//   d_lhs        [m, K]                                  f32 | d_out dtype
Status ragged_dot_dlhs(ConstTensorView d_out, ConstTensorView rhs,
                       std::span<const int32_t> group_sizes, TensorView d_lhs,
                       const RaggedDotOptions& options = {});

// Weight gradient ("ragged contracting"): for each local group j,
// d_rhs[j - group_offset] = lhs[rows of j]^T @ d_out[rows of j]; exactly 0 for an empty group.
//   lhs          [m, K]                                  f32 | bf16
//   d_out        [m, n]                                  same dtype as lhs
//   d_rhs        [E_loc, K, n]  ([E_loc, n, K] if rhs_transposed)   f32 | lhs dtype
Status ragged_dot_drhs(ConstTensorView lhs, ConstTensorView d_out,
                       std::span<const int32_t> group_sizes, TensorView d_rhs,
                       const RaggedDotOptions& options = {});

// 2 * (rows of the local groups) * K * n: the useful FLOPs of any of the three calls. Local
// groups past the end of group_sizes count 0 rows. -1 for a negative argument or group size, or
// a count past int64.
int64_t ragged_dot_flops(std::span<const int32_t> group_sizes, int32_t group_offset,
                         int64_t num_local_groups, int64_t K, int64_t n);

}  // namespace moekit
