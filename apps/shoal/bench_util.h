// What the `shoal bench` subcommands share: the options of the benchmarks that time training
// steps and of the worker processes they start, running a set of processes at once with a
// deadline, the files through which the workers report, and medians and JSON numbers for the
// reports.
//
// Thread safety: plain functions; run_processes forks, so call it from a benchmark's main thread
// while no other thread holds a lock that a function child would need.
#pragma once

#include <CLI/CLI.hpp>

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace shoal::cli {

/// The options of the benchmarks that time training steps (bench ddp, dp, pipeline); a
/// benchmark's own options derive from it, setting other defaults in their constructor.
struct StepBenchArgs {
  std::string model = "cnn";
  int steps = 10;   ///< timed steps per run
  int warmup = 2;   ///< untimed steps first
  int rounds = 3;   ///< rounds interleaving the modes; medians are reported
  bool json = false;
};

/// Throws InvalidArgument naming `bench` and the built-in models unless `model` is one of them:
/// an image classifier, or one of `also` (bench ddp's "gpt").
void check_bench_model(const std::string& bench, const std::string& model,
                       const std::vector<std::string>& also = {});

/// Registers StepBenchArgs as --model, --steps, --warmup, --rounds and --json; the values in
/// `args` are the defaults shown.
void add_step_options(CLI::App& app, StepBenchArgs& args);

/// The hidden options by which a benchmark runs this program again as one of its workers.
struct WorkerArgs {
  std::string worker;  ///< what the worker runs; empty in the benchmark itself
  int rank = 0;
  std::string store;   ///< the file store of the worker's group
  std::string result;  ///< where the worker writes its Values
};

/// Registers WorkerArgs as the hidden --worker, --rank, --store and --result.
void add_worker_options(CLI::App& app, WorkerArgs& args);

/// The path of bench/`name` in the source tree, where the PyTorch peer scripts are.
std::string bench_script(const std::string& name);

/// A Python with PyTorch that runs the peer scripts: Debian's python3-torch (1.13) or PyTorch 2.x
/// from PyPI (scripts/setup_torch_pypi.sh's folder on PYTHONPATH), so that one run can compare
/// Shoal with both, side by side.
struct TorchPeer {
  std::string name;                 ///< "debian" or "pypi", as given to --torch
  std::string version;              ///< torch.__version__ ("1.13.1"), empty when unavailable
  /// The command that runs the scripts: {"/usr/bin/env", "OPENBLAS_NUM_THREADS=1", "/usr/bin/python3"}
  std::vector<std::string> python;
  bool available() const { return !version.empty(); }
  /// "pytorch 1.13.1"
  std::string label() const { return "pytorch " + version; }
};

/// The peer named `name` ("debian" or "pypi"); its version is empty (and a note printed on stderr
/// with what to do) when that PyTorch cannot be imported with gloo. `benchmark` starts the note.
/// Without `probe`, only the command is filled in (no Python is started; the version stays empty).
TorchPeer find_torch_peer(const std::string& name, const std::string& benchmark, bool probe = true);

/// Registers --torch (a list of debian, pypi; default debian) into `peers`.
void add_torch_option(CLI::App& app, std::vector<std::string>& peers);

/// Named numbers: what a worker process reports, and what a report line is made of.
using Values = std::map<std::string, double>;

/// Seconds from `start` to now.
double seconds_since(std::chrono::steady_clock::time_point start);

/// The median of `values`; NaN when there are none.
double median(std::vector<double> values);

/// `value` as a JSON number (6 significant digits), or null when it is not finite.
std::string json_number(double value);

/// Writes `values` to `path`, one "key value" line each. `benchmark` ("bench ddp") starts the
/// error message.
void write_values(const std::string& path, const Values& values, const std::string& benchmark);

/// What write_values wrote; no values when the file is missing.
Values read_values(const std::string& path);

/// The numbers of the flat JSON object in `path`, as the PyTorch peer scripts write it.
Values read_json_numbers(const std::string& path);

/// One process of a run started by run_processes: either a command line, or a function run in a
/// forked copy of this process.
struct ChildProcess {
  /// execvp'd: argv[0] is looked up on PATH when it has no slash.
  std::vector<std::string> argv;
  /// Used instead of argv when set: its return value is the exit status; an exception it throws
  /// is printed to stderr and exits 1.
  std::function<int()> function;
  /// Names a function child in the message of an exception it throws ("GPipe M=4 rank 1").
  std::string label;
  /// Sends the child's stdout and stderr to /dev/null.
  bool quiet = false;
  /// Sends the child's stdout and stderr to this file (made or truncated) unless quiet.
  std::string output;
  /// "NAME=value" entries added to the child's environment.
  std::vector<std::string> environment;
};

struct RunProcessesOptions {
  /// Starts every message: "bench ddp".
  std::string benchmark;
  /// What the children are together, for the timeout message: "the single run", "mpirun".
  std::string run;
  /// How long the children may take together before they are stopped: far above a normal run,
  /// so that only a hang hits it.
  std::chrono::seconds deadline{600};
  /// Past the deadline, SIGTERM first and SIGKILL this much later (for a child that stops its
  /// own children on SIGTERM, as mpirun does); 0: SIGKILL at once.
  std::chrono::seconds grace{0};
};

/// Starts every child at once and waits for all of them. Returns 0 when every one exited 0, else
/// the status of the first (in `children`'s order) that did not: its exit code, or 128 + the
/// signal that ended it. Past the deadline, stops and reaps them all and throws TimeoutError.
/// The children share this process's process group, so a Ctrl-C reaches them too.
int run_processes(const std::vector<ChildProcess>& children, const RunProcessesOptions& options);

}  // namespace shoal::cli
