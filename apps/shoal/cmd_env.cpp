// `shoal env`: the environment variables Shoal reads, from the table in shoal/env.h.
#include <cstdio>
#include <memory>
#include <string>

#include "commands.h"
#include "shoal/env.h"

namespace shoal::cli {

void add_env_command(CLI::App& root, std::vector<Command>& commands) {
  CLI::App* app = root.add_subcommand(
      "env", "List the environment variables Shoal reads: values, default, what each does");
  auto markdown = std::make_shared<bool>(false);
  app->add_flag("--markdown", *markdown, "Print the table as docs/GUIDE.md holds it");
  commands.push_back({app, [markdown] {
                        const std::string text = *markdown ? env::markdown_table() : env::listing();
                        std::fputs(text.c_str(), stdout);
                        return 0;
                      }});
}

}  // namespace shoal::cli
