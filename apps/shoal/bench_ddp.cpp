// Placeholder: `shoal bench ddp` arrives with its issue.
#include <cstdio>

#include "commands.h"

namespace shoal::cli {

void add_bench_ddp_command(CLI::App& bench, std::vector<Command>& commands) {
  auto* app = bench.add_subcommand("ddp", "(not available yet)");
  commands.push_back({app, [] {
                        std::fprintf(stderr, "shoal bench ddp: not available yet\n");
                        return 2;
                      }});
}

}  // namespace shoal::cli
