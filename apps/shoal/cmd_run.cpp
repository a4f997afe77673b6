// Placeholder: `shoal run` arrives with its issue.
#include <cstdio>

#include "commands.h"

namespace shoal::cli {

void add_run_command(CLI::App& root, std::vector<Command>& commands) {
  auto* app = root.add_subcommand("run", "(not available yet)");
  commands.push_back({app, [] {
                        std::fprintf(stderr, "shoal run: not available yet\n");
                        return 2;
                      }});
}

}  // namespace shoal::cli
