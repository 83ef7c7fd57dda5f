// Internal: the block lists every engine's exchange_start checks before it posts anything.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <limits>
#include <span>

#include "check.h"
#include "moekit/ep.h"

namespace moekit::detail {

// Peers in [0, P), rows in [0, max_rows], data where rows > 0, and a byte count that fits int64.
template <class Block>
Status check_blocks(const char* op, const char* name, std::span<const Block> blocks, int P,
                    size_t row_bytes, int64_t max_rows = std::numeric_limits<int64_t>::max()) {
  for (size_t i = 0; i < blocks.size(); ++i) {
    const Block& b = blocks[i];
    int64_t bytes = 0;
    if (b.peer < 0 || b.peer >= P || b.rows < 0 || b.rows > max_rows || (b.rows > 0 && !b.data) ||
        !mul_fits(b.rows, static_cast<int64_t>(row_bytes), &bytes)) {
      return Status::invalid_argument(
          op, fmt::format("{}[{}]", name, i),
          fmt::format("{{peer {}, rows {}, data {}}}", b.peer, b.rows,
                      static_cast<const void*>(b.data)),
          fmt::format("needs a peer in [0, {}), rows in [0, {}] and data for rows > 0", P,
                      max_rows));
    }
  }
  return {};
}

}  // namespace moekit::detail
