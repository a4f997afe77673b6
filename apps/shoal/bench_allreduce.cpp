// Placeholder: `shoal bench allreduce` arrives with its issue.
#include <cstdio>

#include "commands.h"

namespace shoal::cli {

void add_bench_allreduce_command(CLI::App& bench, std::vector<Command>& commands) {
  auto* app = bench.add_subcommand("allreduce", "(not available yet)");
  commands.push_back({app, [] {
                        std::fprintf(stderr, "shoal bench allreduce: not available yet\n");
                        return 2;
                      }});
}

}  // namespace shoal::cli
