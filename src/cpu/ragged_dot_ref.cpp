// Scalar reference for ragged_dot: the obvious loops, straight from SPEC.md section 1. Slow on
// purpose; the tests hold every other implementation to it.
#include "cpu/grouped_gemm.h"

namespace moekit::detail {

Status row_grouped_gemm_ref(const RowGroupedGemm& g) {
  const Groups& gr = g.groups;
  const RowRange local = local_rows(gr);
  if (!g.accumulate) {
    zero_rows(g.c, g.out_type, g.ldc, g.n, 0, local.begin);
    zero_rows(g.c, g.out_type, g.ldc, g.n, local.end, g.m);
  }
  int64_t row = local.begin;
  for (int64_t j = 0; j < gr.num_local; ++j) {
    const int64_t rows = gr.sizes[gr.offset + j];
    for (int64_t r = row; r < row + rows; ++r) {
      for (int64_t c = 0; c < g.n; ++c) {
        float acc = 0.f;
        for (int64_t k = 0; k < g.kc; ++k) {
          acc +=
              load_as_float(g.a, g.in_type, r * g.lda + k) *
              load_as_float(g.b, g.in_type,
                            j * g.b_batch + (g.b_packed ? packed_b_offset(g.b_s0, k, c, g.in_type)
                                                        : k * g.b_s0 + c * g.b_s1));
        }
        const int64_t o = r * g.ldc + c;
        if (g.accumulate) acc += load_as_float(g.c, g.out_type, o);
        store_float(g.c, g.out_type, o, acc);
      }
    }
    row += rows;
  }
  return {};
}

Status contraction_grouped_gemm_ref(const ContractionGroupedGemm& g) {
  const Groups& gr = g.groups;
  int64_t row = local_rows(gr).begin;
  for (int64_t j = 0; j < gr.num_local; ++j) {
    const int64_t rows = gr.sizes[gr.offset + j];
    for (int64_t i = 0; i < g.p; ++i) {
      for (int64_t c = 0; c < g.q; ++c) {
        float acc = 0.f;
        for (int64_t r = row; r < row + rows; ++r) {
          acc += load_as_float(g.x, g.in_type, r * g.ldx + i) *
                 load_as_float(g.y, g.in_type, r * g.ldy + c);
        }
        const int64_t o = j * g.c_batch + i * g.ldc + c;
        if (g.accumulate) acc += load_as_float(g.c, g.out_type, o);
        store_float(g.c, g.out_type, o, acc);
      }
    }
    row += rows;
  }
  return {};
}

}  // namespace moekit::detail
