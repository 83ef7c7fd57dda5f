// Internal: the step every expert-parallel op takes before it moves anything. Each rank brings
// its verdict on its own arguments and a few values that must be the same on every rank; one
// all-gather later, every rank returns the same answer: ok, the first failing rank's error, or
// the first value that differs between ranks. So an error on one rank reaches every rank, and
// no rank goes on into an exchange that another has left.
#pragma once

#include <cstdint>
#include <span>

#include "moekit/ep.h"
#include "moekit/status.h"

namespace moekit::detail {

// A value that every rank must hold the same of; `is_dtype` prints it as a dtype name.
struct AgreedValue {
  const char* name;
  int64_t value;
  bool is_dtype = false;
};

// Collective. At most 4 values, the same names in the same order on every rank.
Status agree(Communicator& comm, const char* op, const Status& local,
             std::span<const AgreedValue> values = {});

}  // namespace moekit::detail
