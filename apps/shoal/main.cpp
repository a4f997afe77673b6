// `shoal`: the launcher, the built-in trainer, benchmarks and checkpoint tools.
//
// Every error, from the command line's parser or from Shoal, is one line on stderr in one style:
// "shoal: error: MESSAGE". Exit status 2 for a bad command line (a flag that does not parse, a value
// out of its range, options that do not go together), 1 for a failure while running.
#include <c10/util/Exception.h>

#include <csignal>
#include <cstdio>
#include <exception>
#include <string>

#include "commands.h"
#include "log/error_file.h"
#include "shoal/error.h"
#include "shoal/launcher/launch.h"

namespace {

/// The subcommand chain the user typed ("shoal bench ddp"), for the --help hint.
std::string parsed_command(const CLI::App& app) {
  std::string name = app.get_name();
  for (const CLI::App* sub : app.get_subcommands()) {
    if (sub->parsed()) return name + " " + parsed_command(*sub);
  }
  return name;
}

/// Messages that name their command ("shoal train: ...") lose it: the prefix says "shoal: error:".
std::string without_command_prefix(std::string message) {
  if (message.rfind("shoal", 0) == 0) {
    const size_t colon = message.find(": ");
    if (colon != std::string::npos && colon < 24) message.erase(0, colon + 2);
  }
  return message;
}

// The line that explains a non-zero exit is the command's result, not a diagnostic: it is written
// whatever SHOAL_LOG_LEVEL says (shoal/log.h). A launcher's worker also leaves it in its error
// file, by which the launcher names the worker that failed first.
int report(const std::string& message, int status) {
  const std::string line = without_command_prefix(message);
  std::fprintf(stderr, "shoal: error: %s\n", line.c_str());
  shoal::log::write_error_file(line);
  return status;
}

}  // namespace

namespace {

// main's work; also the entry of workers that `shoal train` and `shoal run` start from this
// program without exec (launcher::set_self_entry).
int run_shoal(int argc, char** argv) {
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
  shoal::cli::add_plot_command(app, commands);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    return report(std::string(e.what()) + " (see '" + parsed_command(app) + " --help')", 2);
  }
  try {
    for (auto& command : commands) {
      if (command.app->parsed()) return command.run();
    }
  } catch (const shoal::InvalidArgument& e) {
    return report(e.what(), 2);
  } catch (const c10::Error& e) {
    return report(e.what_without_backtrace(), 1);
  } catch (const std::exception& e) {
    return report(e.what(), 1);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  shoal::launcher::set_self_entry(&run_shoal);
  return run_shoal(argc, argv);
}
