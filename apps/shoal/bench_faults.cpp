// `shoal bench faults`: what fault tolerance costs DDP, without failures and per failure.
//
// Modes, each a fresh `shoal run --nproc-per-node W ... shoal train --strategy ddp` of one epoch of
// the MLP on the first --samples images of Fashion-MNIST (one intra-op thread per rank):
//   ddp      plain DDP (its default backend, shm on one host), the reference;
//   ddp_gloo plain DDP on gloo, the backend fault tolerance re-forms its groups on;
//   ft       --fault-tolerant, no failure: gloo, one allreduce after backward and the vote;
//   ft_kill  --fault-tolerant, rank --victim SIGKILLed from outside once it has committed
//            --kill-after steps; the survivors finish the epoch.
// Every mode runs between two ddp runs (R A R B R: this machine's speed drifts within a minute);
// vs_ddp is a run's samples/s (the trainer's own figure for the epoch, from rank 0's --metrics)
// over the mean of the two ddp runs beside it, median over the rounds. lost_s (ft_kill) is the time
// from the kill to the survivors' first committed step in the next generation (the first
// survivor's SHOAL_FT_SAMPLE_LOG line "C 1 ..."): the failure's detection, the vote, the group's
// re-forming and one step.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_harness.h"
#include "bench_util.h"
#include "commands.h"
#include "shoal/error.h"
#include "shoal/launcher/launch.h"

namespace shoal::cli {
// Named, not anonymous: the CLI's sources are compiled in unity batches.
namespace bench_faults {

using Clock = std::chrono::steady_clock;
// Far above a normal run (seconds): only a hang reaches it.
constexpr std::chrono::seconds kRunDeadline{600};

struct FaultsBenchArgs {
  int world = 3;
  int64_t samples = 6000;
  int batch = 32;
  int kill_after = 20;  ///< committed steps of the victim before the kill
  int victim = 1;
  int rounds = 3;
  bool json = false;
};

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The committed steps a rank's SHOAL_FT_SAMPLE_LOG file lists in `generation` or later.
int commits_from(const std::string& log, int generation) {
  std::istringstream lines(read_text(log));
  int count = 0;
  for (std::string line; std::getline(lines, line);) {
    std::istringstream in(line);
    std::string tag;
    int line_generation = -1;
    in >> tag >> line_generation;
    count += tag == "C" && line_generation >= generation;
  }
  return count;
}

// The process whose environment holds every one of `entries` ("NAME=value"); -1 when none.
pid_t process_with_environment(const std::vector<std::string>& entries) {
  for (const auto& item : std::filesystem::directory_iterator("/proc")) {
    const std::string name = item.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string environment = read_text(item.path() / "environ");
    std::replace(environment.begin(), environment.end(), '\0', '\n');
    environment = "\n" + environment;
    const bool all = std::all_of(entries.begin(), entries.end(), [&](const std::string& entry) {
      return environment.find("\n" + entry + "\n") != std::string::npos;
    });
    if (all) return std::stoi(name);
  }
  return -1;
}

// Polls `done` every 2 ms until it holds; throws past the deadline.
void wait_for(const std::function<bool()>& done, const std::string& what) {
  const auto deadline = Clock::now() + kRunDeadline;
  while (!done()) {
    SHOAL_CHECK_T(TimeoutError, Clock::now() < deadline, "bench faults: ", what, " never came");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

// The killer of an ft_kill run (a forked child beside the job): SIGKILLs the victim once it has
// committed --kill-after steps and writes lost_s, the kill to the survivors' next generation's
// first commit, to `result`.
int kill_and_time(const FaultsBenchArgs& args, const std::string& samples, const std::string& result) {
  const std::string victim_log = samples + ".rank" + std::to_string(args.victim);
  wait_for([&] { return commits_from(victim_log, 0) >= args.kill_after; },
           "the victim's committed steps");
  const pid_t pid = process_with_environment(
      {"SHOAL_FT_SAMPLE_LOG=" + samples, "RANK=" + std::to_string(args.victim)});
  SHOAL_CHECK(pid > 0, "bench faults: rank ", args.victim, "'s process not found");
  const int survivor = args.victim == 0 ? 1 : 0;
  const std::string survivor_log = samples + ".rank" + std::to_string(survivor);
  const std::vector<std::string> survivor_env = {"SHOAL_FT_SAMPLE_LOG=" + samples,
                                                 "RANK=" + std::to_string(survivor)};
  const auto killed = Clock::now();
  ::kill(pid, SIGKILL);
  // A survivor that ends without another commit was past its last step when the kill came
  // (looked for every 100 ms: a scan of /proc beside the 2 ms polls would slow the survivors).
  int polls = 0;
  wait_for([&] {
    if (commits_from(survivor_log, 1) > 0) return true;
    if (++polls % 50 != 0) return false;
    SHOAL_CHECK_T(InvalidArgument, process_with_environment(survivor_env) > 0 ||
                                       commits_from(survivor_log, 1) > 0,
                  "bench faults: rank ", args.victim, " was killed after the survivors' last "
                  "step; raise --samples or lower --kill-after");
    return false;
  }, "a commit after the kill");
  write_values(result, {{"lost_s", seconds_since(killed)}}, "bench faults");
  return 0;
}

std::vector<std::string> job_command(const FaultsBenchArgs& args, const std::string& mode,
                                     const std::string& stem) {
  std::vector<std::string> command{
      launcher::self_executable(), "run", "--nproc-per-node", std::to_string(args.world),
      "--master-port", "0", launcher::self_executable(), "train", "--strategy", "ddp", "--model",
      "mlp", "--epochs", "1", "--train-samples", std::to_string(args.samples), "--test-samples",
      "200", "--batch-size", std::to_string(args.batch), "--threads", "1", "--no-progress",
      "--metrics", stem + ".metrics"};
  if (mode == "ddp_gloo") command.insert(command.end(), {"--backend", "gloo"});
  if (mode == "ft" || mode == "ft_kill") command.push_back("--fault-tolerant");
  return command;
}

// samples/s of the epoch, as rank 0's trainer measured it.
double epoch_rate(const std::string& metrics) {
  std::istringstream lines(read_text(metrics));
  for (std::string line; std::getline(lines, line);) {
    const nlohmann::json object = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (object.is_object() && object.value("event", "") == "epoch") {
      return object.value("samples_per_s", 0.0);
    }
  }
  SHOAL_THROW(Error, "bench faults: no epoch line in ", metrics);
}

void run_mode(const FaultsBenchArgs& args, const TempDir& dir, BenchMode& mode) {
  static int counter = 0;
  const std::string stem = dir.file("run" + std::to_string(counter++));
  const std::string samples = stem + ".samples";
  const std::string output = stem + ".out";
  ChildProcess job;
  job.argv = job_command(args, mode.name, stem);
  job.output = output;
  std::vector<ChildProcess> children{job};
  if (mode.name == "ft_kill") {
    // Only here: the log costs a write per step, and the killer reads it.
    children[0].environment = {"SHOAL_FT_SAMPLE_LOG=" + samples};
    ChildProcess killer;
    killer.label = "the killer";
    killer.function = [&] { return kill_and_time(args, samples, stem + ".lost"); };
    children.push_back(killer);
  }
  RunProcessesOptions options;
  options.benchmark = "bench faults";
  options.run = "the " + mode.name + " run";
  options.deadline = kRunDeadline;
  const int status = run_processes(children, options);
  SHOAL_CHECK(status == 0, "bench faults: the ", mode.name, " run exited with ", status,
              "; its output:\n", read_text(output));
  mode.add("samples_per_s", epoch_rate(stem + ".metrics"));
  if (mode.name == "ft_kill") mode.add("lost_s", read_values(stem + ".lost").at("lost_s"));
}

void print_mode(const FaultsBenchArgs& args, const BenchMode& mode) {
  if (args.json) {
    ReportLine()
        .add("bench", "faults").add("model", "mlp").add("mode", mode.name)
        .add("ranks", args.world).add("samples_per_s", mode.get("samples_per_s"))
        .add("vs_ddp", mode.get("vs_ddp")).add("lost_s", mode.get("lost_s"))
        .add("rounds", args.rounds)
        .print();
    return;
  }
  std::printf("%-8s %10.1f %8s %8s\n", mode.name.c_str(), mode.get("samples_per_s"),
              cell(mode.get("vs_ddp"), "%.3f").c_str(), cell(mode.get("lost_s"), "%.2f").c_str());
}

int run_faults_bench(const FaultsBenchArgs& args) {
  SHOAL_CHECK_T(InvalidArgument, args.world >= 2 && args.samples >= 1 && args.batch >= 1 &&
                                     args.rounds >= 1 && args.kill_after >= 1,
                "bench faults: needs --world >= 2 and positive --samples, --batch, --kill-after "
                "and --rounds");
  SHOAL_CHECK_T(InvalidArgument, args.victim >= 0 && args.victim < args.world, "bench faults: ",
                "--victim ", args.victim, " is not a rank of --world ", args.world);
  SHOAL_CHECK_T(InvalidArgument,
                static_cast<int64_t>(args.kill_after) * args.world * args.batch < args.samples,
                "bench faults: --kill-after ", args.kill_after, " steps of ", args.world, " x ",
                args.batch, " samples is the whole epoch of --samples ", args.samples,
                "; raise --samples");
  std::vector<BenchMode> modes(4);
  modes[0].name = "ddp";
  modes[1].name = "ddp_gloo";
  modes[2].name = "ft";
  modes[3].name = "ft_kill";
  const TempDir dir("faults");
  std::vector<BenchMode*> all;
  for (auto& mode : modes) all.push_back(&mode);
  run_rounds_beside_first(all, args.rounds, [&](BenchMode& mode) { run_mode(args, dir, mode); },
                          "vs_ddp");
  if (!args.json) {
    std::printf("bench faults: mlp, %d ranks, %lld samples, batch %d per rank, rank %d killed "
                "after %d committed steps (ft_kill), median of %d rounds\n",
                args.world, static_cast<long long>(args.samples), args.batch, args.victim,
                args.kill_after, args.rounds);
    std::printf("%-8s %10s %8s %8s\n", "mode", "samples/s", "vs_ddp", "lost_s");
  }
  for (const auto& mode : modes) print_mode(args, mode);
  if (!args.json) {
    std::printf("vs_ddp = samples/s (the epoch's, rank 0's trainer) / the mean of the two ddp "
                "runs beside it, median over the rounds; lost_s = the kill to the survivors' "
                "first committed step without the victim\n");
  }
  return 0;
}

}  // namespace bench_faults

void add_bench_faults_command(CLI::App& bench, std::vector<Command>& commands) {
  auto args = std::make_shared<bench_faults::FaultsBenchArgs>();
  auto* app = bench.add_subcommand(
      "faults", "Fault-tolerant DDP (--fault-tolerant) vs plain DDP: samples/s without failures, "
                "and the time one SIGKILLed rank costs the survivors");
  app->add_option("--world", args->world, "Ranks of every run")->capture_default_str();
  app->add_option("--samples", args->samples, "Fashion-MNIST training images of the epoch")
      ->capture_default_str();
  app->add_option("--batch", args->batch, "Samples per rank and step")->capture_default_str();
  app->add_option("--kill-after", args->kill_after,
                  "ft_kill: the victim's committed steps before it is killed")
      ->capture_default_str();
  app->add_option("--victim", args->victim, "ft_kill: the rank killed")->capture_default_str();
  app->add_option("--rounds", args->rounds, "Rounds interleaving the modes; medians are reported")
      ->capture_default_str();
  app->add_flag("--json", args->json, "One JSON object per mode instead of the table");
  commands.push_back({app, [args] { return bench_faults::run_faults_bench(*args); }});
}

}  // namespace shoal::cli
