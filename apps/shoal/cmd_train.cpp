// Placeholder: `shoal train` arrives with its issue.
#include <cstdio>

#include "commands.h"

namespace shoal::cli {

void add_train_command(CLI::App& root, std::vector<Command>& commands) {
  auto* app = root.add_subcommand("train", "(not available yet)");
  commands.push_back({app, [] {
                        std::fprintf(stderr, "shoal train: not available yet\n");
                        return 2;
                      }});
}

}  // namespace shoal::cli
