// The moekit command-line program: `moekit bench OP ...`.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <exception>

#include "benches.h"

int main(int argc, char** argv) {
  CLI::App app{"moekit: Mixture-of-Experts kernels (bench and check)"};
  app.require_subcommand(1);
  CLI::App* bench = app.add_subcommand("bench", "Time an op on a model preset's shapes");
  bench->require_subcommand(1);
  moekit::tools::register_bench_ragged_dot(*bench);
  moekit::tools::register_bench_router(*bench);
  moekit::tools::register_bench_permute(*bench);
  moekit::tools::register_bench_layer(*bench);
  moekit::tools::register_bench_dispatch(*bench);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    fmt::print(stderr, "moekit: {}\n", e.what());
    return 1;
  }
  return 0;
}
