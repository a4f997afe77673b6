// Placeholder: `shoal bench` arrives with its issue.
#include <cstdio>

#include "commands.h"

namespace shoal::cli {

void add_bench_command(CLI::App& root, std::vector<Command>& commands) {
  auto* app = root.add_subcommand("bench", "(not available yet)");
  commands.push_back({app, [] {
                        std::fprintf(stderr, "shoal bench: not available yet\n");
                        return 2;
                      }});
}

}  // namespace shoal::cli
