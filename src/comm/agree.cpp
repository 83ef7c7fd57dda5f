#include "comm/agree.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace moekit::detail {
namespace {

constexpr int kMaxValues = 4;

// One rank's verdict, 256 bytes. Strings are cut to fit and always NUL-terminated.
struct Record {
  int32_t code;
  int32_t num_values;
  int64_t values[kMaxValues];
  char argument[48];
  char value[48];
  char what[120];
};
static_assert(sizeof(Record) == 256);

template <size_t N>
void put(char (&dst)[N], const std::string& s) {
  const size_t n = std::min(s.size(), N - 1);
  std::memcpy(dst, s.data(), n);
  dst[n] = '\0';
}

std::string value_str(const AgreedValue& v, int64_t x) {
  if (v.is_dtype && x >= 0 && x <= static_cast<int64_t>(DType::kF16)) {
    return std::string(dtype_name(static_cast<DType>(x)));
  }
  return std::to_string(x);
}

}  // namespace

Status agree(Communicator& comm, const char* op, const Status& local,
             std::span<const AgreedValue> values) {
  const int P = comm.size(), me = comm.rank();
  Record mine{};
  mine.code = static_cast<int32_t>(local.code());
  mine.num_values = static_cast<int32_t>(std::min<size_t>(values.size(), kMaxValues));
  for (int i = 0; i < mine.num_values; ++i) mine.values[i] = values[i].value;
  put(mine.argument, local.argument());
  put(mine.value, local.value());
  put(mine.what, local.what());

  // Reused from call to call: no allocation on the hot path once it has grown.
  thread_local std::vector<Record> all;
  all.resize(static_cast<size_t>(P));
  MOEKIT_RETURN_IF_ERROR(comm.all_gather(&mine, all.data(), sizeof(Record)));

  for (int q = 0; q < P; ++q) {
    const Record& r = all[static_cast<size_t>(q)];
    if (r.code == static_cast<int32_t>(StatusCode::kOk)) continue;
    if (q == me) return local;
    const std::string where = fmt::format("rank {}", q);
    switch (static_cast<StatusCode>(r.code)) {
      case StatusCode::kInvalidArgument:
        return Status::invalid_argument(op, fmt::format("{} on {}", r.argument, where), r.value,
                                        r.what);
      case StatusCode::kUnimplemented:
        return Status::unimplemented(op, fmt::format("on {}: {}", where, r.what));
      default:
        return Status::internal(op, fmt::format("on {}: {}", where, r.what));
    }
  }
  for (int i = 0; i < mine.num_values; ++i) {
    for (int q = 1; q < P; ++q) {
      const int64_t v0 = all[0].values[i], vq = all[static_cast<size_t>(q)].values[i];
      if (all[static_cast<size_t>(q)].num_values != mine.num_values || vq != v0) {
        return Status::invalid_argument(
            op, values[static_cast<size_t>(i)].name,
            fmt::format("{} on rank 0, {} on rank {}", value_str(values[i], v0),
                        value_str(values[i], vq), q),
            "must be the same on every rank");
      }
    }
  }
  return {};
}

}  // namespace moekit::detail
