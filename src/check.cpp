#include "check.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace moekit::detail {

std::string shape_str(const ConstTensorView& v) {
  return fmt::format("[{}]", fmt::join(v.shape.begin(), v.shape.begin() + v.rank, ", "));
}

Status check_exec(const char* op, const Exec& exec) {
  if (exec.device != Device::kCpu && exec.device != Device::kCuda) {
    return Status::invalid_argument(op, "exec.device",
                                    std::to_string(static_cast<int>(exec.device)), "not a Device");
  }
  if (exec.device == Device::kCuda && !cuda_built()) {
    return Status::unimplemented(op, "moekit was built without its CUDA backend");
  }
  return {};
}

Status check_view(const char* op, const char* name, const ConstTensorView& v, int rank) {
  if (v.rank != rank) {
    return Status::invalid_argument(op, fmt::format("{}.rank", name), std::to_string(v.rank),
                                    fmt::format("expected a rank-{} tensor", rank));
  }
  int64_t numel = 1;
  for (int d = 0; d < rank; ++d) {
    if (v.shape[d] < 0) {
      return Status::invalid_argument(op, fmt::format("{}.shape", name), shape_str(v),
                                      "dimensions must be >= 0");
    }
    if (!mul_fits(numel, v.shape[d], &numel)) {
      return Status::invalid_argument(op, fmt::format("{}.shape", name), shape_str(v),
                                      "more elements than a 64-bit count holds");
    }
  }
  if (numel == 0) return {};
  if (v.data == nullptr) {
    return Status::invalid_argument(op, fmt::format("{}.data", name), "null",
                                    fmt::format("a tensor of shape {} needs data", shape_str(v)));
  }
  if (v.stride[rank - 1] != 1) {
    return Status::invalid_argument(op, fmt::format("{}.stride[{}]", name, rank - 1),
                                    std::to_string(v.stride[rank - 1]),
                                    "the innermost dimension must be contiguous (stride 1)");
  }
  // Outer strides keep rows apart; every element's offset, in elements and in bytes, must fit
  // int64 (the last one is sum((shape[d] - 1) * stride[d]) from data), so that no address
  // computed from them wraps.
  int64_t last = 0;
  for (int d = rank - 1; d >= 0; --d) {
    if (d < rank - 1) {
      int64_t inner_extent = 0;
      if (!mul_fits(v.shape[d + 1], v.stride[d + 1], &inner_extent) || v.stride[d] < inner_extent) {
        return Status::invalid_argument(
            op, fmt::format("{}.stride[{}]", name, d), std::to_string(v.stride[d]),
            fmt::format("must be >= shape[{}] * stride[{}] so that elements do not overlap", d + 1,
                        d + 1));
      }
    }
    int64_t span = 0;
    if (!mul_fits(v.shape[d] - 1, v.stride[d], &span) ||
        __builtin_add_overflow(last, span, &last)) {
      return Status::invalid_argument(
          op, fmt::format("{}.stride[{}]", name, d), std::to_string(v.stride[d]),
          fmt::format("with shape {}, offsets past 64 bits", shape_str(v)));
    }
  }
  int64_t bytes = 0;
  if (last == INT64_MAX || !mul_fits(last + 1, static_cast<int64_t>(dtype_size(v.dtype)), &bytes)) {
    return Status::invalid_argument(
        op, fmt::format("{}.shape", name), shape_str(v),
        fmt::format("its last element lies {} elements from data: past 64-bit byte offsets", last));
  }
  return {};
}

Status check_input_dtype(const char* op, const char* name, DType t) {
  if (t == DType::kF32 || t == DType::kBF16) return {};
  return Status::invalid_argument(op, fmt::format("{}.dtype", name), std::string(dtype_name(t)),
                                  "expected f32 or bf16");
}

Status check_same_dtype(const char* op, const char* name, DType t, const char* ref_name,
                        DType ref) {
  if (t == ref) return {};
  return Status::invalid_argument(
      op, fmt::format("{}.dtype", name), std::string(dtype_name(t)),
      fmt::format("must equal {}.dtype ({})", ref_name, dtype_name(ref)));
}

Status check_output_dtype(const char* op, const char* name, DType t, DType in) {
  if (t == DType::kF32 || t == in) return {};
  return Status::invalid_argument(
      op, fmt::format("{}.dtype", name), std::string(dtype_name(t)),
      fmt::format("expected f32 or the input dtype ({})", dtype_name(in)));
}

Status check_dim(const char* op, const char* name, const ConstTensorView& v, int dim,
                 int64_t expected, const char* expected_what) {
  if (v.shape[dim] == expected) return {};
  return Status::invalid_argument(
      op, fmt::format("{}.shape", name), shape_str(v),
      fmt::format("dimension {} must be {} = {}", dim, expected_what, expected));
}

Status check_dtype(const char* op, const char* name, DType t, DType want) {
  if (t == want) return {};
  return Status::invalid_argument(op, fmt::format("{}.dtype", name), std::string(dtype_name(t)),
                                  fmt::format("expected {}", dtype_name(want)));
}

Status check_matrix(const char* op, const char* name, const ConstTensorView& v, int64_t rows,
                    const char* rows_what, int64_t cols, const char* cols_what) {
  MOEKIT_RETURN_IF_ERROR(check_view(op, name, v, 2));
  MOEKIT_RETURN_IF_ERROR(check_dim(op, name, v, 0, rows, rows_what));
  return check_dim(op, name, v, 1, cols, cols_what);
}

Region::Region(const char* name, const ConstTensorView& v) : name(name) {
  if (v.rank == 0 || v.data == nullptr || v.numel() == 0) return;
  const uint64_t size = dtype_size(v.dtype);
  first = reinterpret_cast<uintptr_t>(v.data);
  // Rows of the outermost dimension, each the inner dimensions' extent (contiguous or not).
  uint64_t inner_last = 0;
  for (int d = 1; d < v.rank; ++d) {
    inner_last += static_cast<uint64_t>(v.shape[d] - 1) * static_cast<uint64_t>(v.stride[d]);
  }
  rows = static_cast<uint64_t>(v.shape[0]);
  row_stride = static_cast<uint64_t>(v.stride[0]) * size;
  row_bytes = (inner_last + 1) * size;
  if (v.rank == 1) rows = 1, row_stride = 0, row_bytes = static_cast<uint64_t>(v.shape[0]) * size;
}

Region::Region(const char* name, const void* data, size_t bytes)
    : name(name),
      first(reinterpret_cast<uintptr_t>(data)),
      rows(data != nullptr && bytes > 0 ? 1 : 0),
      row_bytes(bytes) {}

namespace {
uint64_t extent(const Region& r) { return (r.rows - 1) * r.row_stride + r.row_bytes; }
}  // namespace

bool overlap(const Region& a, const Region& b) {
  if (a.empty() || b.empty()) return false;
  if (a.first + extent(a) <= b.first || b.first + extent(b) <= a.first) return false;
  // Rows with one period S (a single row takes the other's): each region's rows lie at the same
  // place within every period, so they meet only if those places do.
  const uint64_t S = a.rows > 1 ? a.row_stride : b.row_stride;
  if (S == 0 || (a.rows > 1 && b.rows > 1 && a.row_stride != b.row_stride)) return true;
  const uintptr_t base = std::min(a.first, b.first);
  const uint64_t oa = (a.first - base) % S, ob = (b.first - base) % S;
  if (oa + a.row_bytes > S || ob + b.row_bytes > S) return true;  // rows wider than the period
  return oa < ob + b.row_bytes && ob < oa + a.row_bytes;
}

Status check_disjoint(const char* op, std::span<const Region> outputs,
                      std::span<const Region> inputs) {
  for (auto out = outputs.begin(); out != outputs.end(); ++out) {
    for (auto other = outputs.begin(); other != out; ++other) {
      if (overlap(*out, *other)) {
        return Status::invalid_argument(op, out->name, fmt::format("at {:#x}", out->first),
                                        fmt::format("overlaps {} (another output): outputs "
                                                    "must not share memory",
                                                    other->name));
      }
    }
    for (const Region& in : inputs) {
      if (overlap(*out, in)) {
        return Status::invalid_argument(op, out->name, fmt::format("at {:#x}", out->first),
                                        fmt::format("overlaps {} (an input): no op runs in "
                                                    "place",
                                                    in.name));
      }
    }
  }
  return {};
}

}  // namespace moekit::detail
