// `shoal`: the launcher, the built-in trainer, benchmarks and checkpoint tools.
//
// Every error, from the command line's parser or from Shoal, is one line on stderr in one style:
// "shoal: error: MESSAGE". Exit status 2 for a bad command line (a flag that does not parse, a value
// out of its range, options that do not go together), 1 for a failure while running.
#include <c10/util/Exception.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

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

/// The deepest subcommand the user typed ("bench" of "shoal bench ddp" is not it: "ddp" is).
const CLI::App& parsed_leaf(const CLI::App& app) {
  for (const CLI::App* sub : app.get_subcommands()) {
    if (sub->parsed()) return parsed_leaf(*sub);
  }
  return app;
}

/// Edit distance (insertions, deletions, substitutions, swaps of neighbours) between a and b.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t change = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + change});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

/// What `command` accepts in the place of `word`: its flags ("--epochs", "-o") for a word that
/// starts with '-', else its subcommands' names.
std::vector<std::string> accepted_words(const CLI::App& command, const std::string& word) {
  std::vector<std::string> names;
  if (word.rfind('-', 0) == 0) {
    for (const CLI::Option* option : command.get_options()) {
      for (const std::string& name : option->get_lnames()) names.push_back("--" + name);
      for (const std::string& name : option->get_snames()) names.push_back("-" + name);
    }
  } else {
    for (const CLI::App* sub : command.get_subcommands({})) names.push_back(sub->get_name());
  }
  return names;
}

/// The nearest word `command` accepts in the place of `word` ("--epoch" -> "--epochs"), or "" when
/// none is near enough to be what the user meant (a third of the word's letters, at least 2).
std::string nearest_word(const CLI::App& command, std::string word) {
  word = word.substr(0, word.find('='));  // --epoch=2
  const size_t limit = std::max<size_t>(2, word.size() / 3);
  std::string best;
  size_t best_distance = limit + 1;
  for (const std::string& name : accepted_words(command, word)) {
    const size_t distance = edit_distance(word, name);
    if (distance < best_distance) {
      best = name;
      best_distance = distance;
    }
  }
  return best;
}

/// For the first word the command did not expect that is near one it accepts: "--epoch is not a
/// flag of 'shoal train'; did you mean --epochs?"; else the parser's own message.
std::string with_suggestion(const CLI::App& app, const std::string& message) {
  const CLI::App& command = parsed_leaf(app);
  for (const std::string& word : app.remaining(true)) {
    const std::string nearest = nearest_word(command, word);
    if (nearest.empty()) continue;
    const bool flag = word.rfind('-', 0) == 0;
    return word.substr(0, word.find('=')) + " is not a " + (flag ? "flag" : "subcommand") +
           " of '" + parsed_command(app) + "'; did you mean " + nearest + "?";
  }
  return message;
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
  shoal::cli::add_generate_command(app, commands);
  shoal::cli::add_data_command(app, commands);
  shoal::cli::add_env_command(app, commands);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ExtrasError& e) {
    return report(with_suggestion(app, e.what()) + " (see '" + parsed_command(app) + " --help')", 2);
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
