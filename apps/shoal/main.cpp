// `shoal`: the launcher, the built-in trainer, benchmarks and checkpoint tools.
#include <csignal>
#include <cstdio>
#include <exception>

#include "commands.h"
#include "shoal/error.h"

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);
  CLI::App app{
      "Shoal: distributed training for LibTorch (the PyTorch C++ API).\n"
      "Data parallelism in one process and across processes and machines, a launcher, and\n"
      "PyTorch-compatible checkpoints.",
      "shoal"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "shoal 0.1.0");

  std::vector<shoal::cli::Command> commands;
  shoal::cli::add_train_command(app, commands);
  shoal::cli::add_run_command(app, commands);
  shoal::cli::add_bench_command(app, commands);
  shoal::cli::add_ckpt_command(app, commands);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    for (auto& command : commands) {
      if (command.app->parsed()) return command.run();
    }
  } catch (const shoal::Error& e) {
    std::fprintf(stderr, "shoal: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shoal: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
