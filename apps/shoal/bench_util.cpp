// What the `shoal bench` subcommands share (bench_util.h).
#include "bench_util.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "launcher/exit_status.h"
#include "shoal/error.h"
#include "shoal/log.h"
#include "shoal/models/registry.h"

#ifndef SHOAL_SOURCE_DIR
#define SHOAL_SOURCE_DIR "."
#endif

namespace shoal::cli {
namespace {

using Clock = std::chrono::steady_clock;

// How often run_processes looks whether its children have ended: short against any run
// (seconds at least), long enough that the looking costs nothing.
constexpr std::chrono::milliseconds kPollInterval{20};

// In a child, after fork: runs the function or execs the command line; never returns.
[[noreturn]] void become_child(const ChildProcess& child, const std::string& benchmark) {
  const std::string sink = child.quiet ? "/dev/null" : child.output;
  if (!sink.empty()) {
    const int fd = ::open(sink.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd >= 0) {
      ::dup2(fd, STDOUT_FILENO);
      ::dup2(fd, STDERR_FILENO);
    }
  }
  for (const auto& entry : child.environment) ::putenv(const_cast<char*>(entry.c_str()));
  if (child.function) {
    int code = 1;
    try {
      code = child.function();
    } catch (const std::exception& e) {
      log::error(benchmark, ": ", child.label, child.label.empty() ? "" : ": ", e.what());
    }
    std::fflush(nullptr);
    ::_exit(code);
  }
  // shoal ignores SIGPIPE, and an ignored disposition survives exec: a command starts with the
  // default, as it would from a shell.
  ::signal(SIGPIPE, SIG_DFL);
  std::vector<char*> argv;
  for (const auto& word : child.argv) argv.push_back(const_cast<char*>(word.c_str()));
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  log::error(benchmark, ": cannot run ", argv[0], ": ", std::strerror(errno));
  ::_exit(127);
}

// Stops the children still running (statuses[i] < 0) and reaps them: SIGTERM and up to `grace`
// for them to end, then SIGKILL.
void stop_children(const std::vector<pid_t>& pids, std::vector<int>& statuses,
                   std::chrono::seconds grace) {
  auto signal_running = [&](int signal) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (statuses[i] < 0) ::kill(pids[i], signal);
    }
  };
  if (grace.count() > 0) {
    signal_running(SIGTERM);
    const auto give_up = Clock::now() + grace;
    bool running = true;
    while (running && Clock::now() < give_up) {
      std::this_thread::sleep_for(kPollInterval);
      running = false;
      for (size_t i = 0; i < pids.size(); ++i) {
        int status = 0;
        if (statuses[i] < 0 && ::waitpid(pids[i], &status, WNOHANG) == pids[i]) {
          statuses[i] = launcher::ExitStatus::from_wait_status(status).shell_code();
        }
        running = running || statuses[i] < 0;
      }
    }
  }
  signal_running(SIGKILL);
  for (size_t i = 0; i < pids.size(); ++i) {
    int status = 0;
    if (statuses[i] < 0 && ::waitpid(pids[i], &status, 0) == pids[i]) {
      statuses[i] = launcher::ExitStatus::from_wait_status(status).shell_code();
    }
  }
}

}  // namespace

void check_bench_model(const std::string& bench, const std::string& model,
                       const std::vector<std::string>& also) {
  // The benches feed image batches (the models built for an image's shape) unless they say.
  if (models::needs_input_shape(model)) return;
  if (std::find(also.begin(), also.end(), model) != also.end()) return;
  std::string names;
  for (const auto& name : models::list_models()) {
    const bool fed = models::needs_input_shape(name) ||
                     std::find(also.begin(), also.end(), name) != also.end();
    if (fed) names += (names.empty() ? "" : ", ") + name;
  }
  SHOAL_THROW(InvalidArgument, bench, ": --model must be a built-in model (", names, "), not '",
              model, "'");
}

void add_step_options(CLI::App& app, StepBenchArgs& args) {
  app.add_option("--model", args.model, "a built-in model: cnn, mlp or transformer")->capture_default_str();
  app.add_option("--steps", args.steps, "timed steps per run")->capture_default_str();
  app.add_option("--warmup", args.warmup, "untimed steps first")->capture_default_str();
  app.add_option("--rounds", args.rounds, "interleaved rounds (medians are reported)")
      ->capture_default_str();
  app.add_flag("--json", args.json, "one JSON object per line");
}

void add_worker_options(CLI::App& app, WorkerArgs& args) {
  app.add_option("--worker", args.worker)->group("");
  app.add_option("--rank", args.rank)->group("");
  app.add_option("--store", args.store)->group("");
  app.add_option("--result", args.result)->group("");
}

std::string bench_script(const std::string& name) {
  return std::string(SHOAL_SOURCE_DIR) + "/bench/" + name;
}

namespace {

// Runs `command` through the shell; its stdout with the trailing newline removed, or "" on failure.
std::string shell_output(const std::string& command) {
  std::string out;
  if (FILE* pipe = ::popen(command.c_str(), "r")) {
    char buffer[256];
    while (std::fgets(buffer, sizeof buffer, pipe)) out += buffer;
    if (::pclose(pipe) != 0) return "";
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

std::string shell_quote(const std::string& word) {
  std::string quoted = "'";
  for (char c : word) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

}  // namespace

TorchPeer find_torch_peer(const std::string& name, const std::string& benchmark, bool probe) {
  TorchPeer peer;
  peer.name = name;
  // One BLAS thread, as Shoal's ranks run (compat::set_compute_threads): Debian's PyTorch calls
  // OpenBLAS, whose pool torch.set_num_threads(1) leaves at the core count, spinning while idle.
  const std::string one_blas_thread = "OPENBLAS_NUM_THREADS=1";
  if (name == "debian") {
    peer.python = {"/usr/bin/env", one_blas_thread, "/usr/bin/python3"};
  } else if (name == "pypi") {
    // The folder scripts/setup_torch_pypi.sh installs the wheel into (it prints <folder>/torch).
    const std::string script = std::string(SHOAL_SOURCE_DIR) + "/scripts/setup_torch_pypi.sh";
    const std::string torch_dir = shell_output("bash " + shell_quote(script) + " --prefix");
    const std::string folder = torch_dir.substr(0, torch_dir.rfind('/'));
    // The wheel is for CPython 3.11: the python3 first on PATH, as test_torchrun.sh uses.
    peer.python = {"/usr/bin/env", one_blas_thread, "PYTHONPATH=" + folder, "python3"};
  } else {
    SHOAL_THROW(InvalidArgument, benchmark, ": --torch '", name, "' is not known; use debian "
                "(python3-torch 1.13) and/or pypi (PyTorch 2.x from scripts/setup_torch_pypi.sh)");
  }
  if (!probe) return peer;
  std::string command;
  for (const auto& word : peer.python) command += shell_quote(word) + " ";
  peer.version = shell_output(
      command + "-c 'import torch, torch.distributed as d; assert d.is_gloo_available(); "
                "print(torch.__version__.split(\"+\")[0])' 2>/dev/null");
  if (!peer.available()) {
    log::warn(benchmark, ": the ", name, " PyTorch cannot be imported (", command,
              "); its modes are skipped",
              name == "pypi" ? " (install it with scripts/setup_torch_pypi.sh)"
                             : " (install python3-torch)");
  }
  return peer;
}

void add_torch_option(CLI::App& app, std::vector<std::string>& peers) {
  app.add_option("--torch", peers,
                 "PyTorch peers, each measured: debian (python3-torch 1.13), pypi (PyTorch 2.x "
                 "from scripts/setup_torch_pypi.sh)")
      ->delimiter(',')
      ->check(CLI::IsMember({"debian", "pypi"}))
      ->capture_default_str();
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> values) {
  if (values.empty()) return std::nan("");
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

std::string json_number(double value) {
  if (!std::isfinite(value)) return "null";
  char text[64];
  std::snprintf(text, sizeof text, "%.6g", value);
  return text;
}

void write_values(const std::string& path, const Values& values, const std::string& benchmark) {
  std::ofstream out(path);
  for (const auto& [key, value] : values) out << key << " " << value << "\n";
  SHOAL_CHECK(out.good(), benchmark, ": cannot write ", path);
}

Values read_values(const std::string& path) {
  Values values;
  std::ifstream in(path);
  std::string key;
  double value;
  while (in >> key >> value) values[key] = value;
  return values;
}

Values read_json_numbers(const std::string& path) {
  std::ifstream in(path);
  Values values;
  if (!in.good()) return values;
  // A peer that died mid-write leaves a partial object: no values, as for a missing file.
  const nlohmann::json object = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!object.is_object()) return values;
  for (const auto& [key, value] : object.items()) {
    if (value.is_number()) values[key] = value.get<double>();
  }
  return values;
}

int run_processes(const std::vector<ChildProcess>& children, const RunProcessesOptions& options) {
  // What this process has buffered would otherwise be written again by each function child.
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  std::vector<int> statuses;  // shell-style exit status of each child; -1 while it runs
  for (const auto& child : children) {
    SHOAL_CHECK_T(InvalidArgument, child.function || !child.argv.empty(), options.benchmark,
                  ": a child process of ", options.run, " has neither a command nor a function");
    const pid_t pid = ::fork();
    if (pid == 0) become_child(child, options.benchmark);
    if (pid < 0) {
      const int error = errno;
      stop_children(pids, statuses, std::chrono::seconds(0));
      SHOAL_THROW(Error, options.benchmark, ": fork failed for ", options.run, ": ",
                  std::strerror(error));
    }
    pids.push_back(pid);
    statuses.push_back(-1);
  }
  const auto deadline = Clock::now() + options.deadline;
  size_t running = pids.size();
  while (running > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (statuses[i] >= 0) continue;
      int status = 0;
      const pid_t done = ::waitpid(pids[i], &status, WNOHANG);
      if (done == pids[i]) {
        statuses[i] = launcher::ExitStatus::from_wait_status(status).shell_code();
        --running;
      } else if (done < 0 && errno != EINTR) {
        const int error = errno;
        stop_children(pids, statuses, std::chrono::seconds(0));
        SHOAL_THROW(Error, options.benchmark, ": waiting for ", options.run, " (pid ", pids[i],
                    "): ", std::strerror(error));
      }
    }
    if (running == 0) break;
    if (Clock::now() > deadline) {
      std::string running_pids;
      for (size_t i = 0; i < pids.size(); ++i) {
        if (statuses[i] < 0) running_pids += (running_pids.empty() ? "" : ", ") + std::to_string(pids[i]);
      }
      stop_children(pids, statuses, options.grace);
      SHOAL_THROW(TimeoutError, options.benchmark, ": ", options.run, " ran past ",
                  options.deadline.count(), " s and was stopped (pid ", running_pids,
                  "); its output above says where it was");
    }
    std::this_thread::sleep_for(kPollInterval);
  }
  for (const int status : statuses) {
    if (status != 0) return status;
  }
  return 0;
}

}  // namespace shoal::cli
