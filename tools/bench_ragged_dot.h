#pragma once

#include <CLI/CLI.hpp>

namespace moekit::tools {

// Adds `ragged_dot` under the `bench` subcommand.
void register_bench_ragged_dot(CLI::App& bench);

}  // namespace moekit::tools
