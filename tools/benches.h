// The `moekit bench OP` subcommands, one register function per op family.
#pragma once

#include <CLI/CLI.hpp>

namespace moekit::tools {

// Adds `ragged_dot` under the `bench` subcommand (tools/bench_ragged_dot.cpp).
void register_bench_ragged_dot(CLI::App& bench);
// Adds `router` under the `bench` subcommand (tools/bench_router.cpp).
void register_bench_router(CLI::App& bench);
// Adds `permute` under the `bench` subcommand (tools/bench_permute.cpp).
void register_bench_permute(CLI::App& bench);
// Adds `layer` under the `bench` subcommand (tools/bench_layer.cpp).
void register_bench_layer(CLI::App& bench);
// Adds `dispatch` under the `bench` subcommand (tools/bench_dispatch.cpp).
void register_bench_dispatch(CLI::App& bench);

}  // namespace moekit::tools
