// The moekit command-line program: `moekit bench OP ...`.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <CLI/CLI.hpp>
#include <exception>
#include <string>
#include <vector>

#include "benches.h"

namespace {

// The name of an unknown subcommand of `app` at argv[i], with the known ones, or "" (CLI11 would
// only say that a subcommand is required).
std::string unknown_subcommand(const CLI::App& app, int argc, char** argv, int i) {
  if (i >= argc || argv[i][0] == '-') return "";
  std::vector<std::string> known;
  for (const CLI::App* sub : app.get_subcommands({})) {
    if (sub->get_name() == argv[i]) return "";
    known.push_back(sub->get_name());
  }
  const std::string path = app.get_parent() ? "moekit " + app.get_name() : "moekit";
  return fmt::format("{}: unknown command '{}'; known: {}", path, argv[i], fmt::join(known, ", "));
}

}  // namespace

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
  for (auto [level, index] : {std::pair<const CLI::App*, int>{&app, 1}, {bench, 2}}) {
    if (index > 1 && (argc < 2 || std::string(argv[1]) != "bench")) break;
    const std::string unknown = unknown_subcommand(*level, argc, argv, index);
    if (!unknown.empty()) {
      fmt::print(stderr, "{}\nRun with --help for more information.\n", unknown);
      return 2;
    }
  }
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
