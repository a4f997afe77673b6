// Placeholder: `shoal ckpt` arrives with its issue.
#include <cstdio>

#include "commands.h"

namespace shoal::cli {

void add_ckpt_command(CLI::App& root, std::vector<Command>& commands) {
  auto* app = root.add_subcommand("ckpt", "(not available yet)");
  commands.push_back({app, [] {
                        std::fprintf(stderr, "shoal ckpt: not available yet\n");
                        return 2;
                      }});
}

}  // namespace shoal::cli
