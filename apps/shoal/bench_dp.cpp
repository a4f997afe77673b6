// `shoal bench dp`: data parallelism in one process against one thread and against processes, on
// the same model and global batch, side by side: is "DDP faster than DP" true here, and why.
//
// Modes, each a fresh process (or K processes), one intra-op thread per replica or rank:
//   single       one thread, the whole batch B
//   independent  K processes with B/K each and no communication: the ceiling of any K-way data
//                parallelism on this machine (they share its cores, caches and memory bandwidth)
//   shoal_dp     shoal::DataParallel over K CPU slots, batch B
//   shoal_ddp    K processes, shoal::DistributedDataParallel (shm), B/K each
//   pytorch_dp_module  torch.nn.DataParallel as it is (on CPU it runs the module alone)
//   pytorch_dp   nn.DataParallel's algorithm on K CPU "devices" with Python threads (dp_torch.py)
//   pytorch_ddp  K processes, PyTorch's DDP over gloo, B/K each
// Rounds interleave the modes; the report gives medians. For shoal_dp and pytorch_dp, the step's
// time split into phases (ms per step): scatter, replicate, forward (wall of the parallel
// forwards) and the slowest replica's forward, gather, backward (and the slowest replica's),
// gradient reduction, optimizer, and the overhead over the slowest replica's compute:
// step - slowest forward - slowest backward - optimizer.
#include <unistd.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "bench_harness.h"
#include "bench_util.h"
#include "commands.h"
#include "compat/thread_parallelism.h"
#include "shoal/comm/init.h"
#include "shoal/comm/store.h"
#include "shoal/error.h"
#include "shoal/log.h"
#include "shoal/launcher/launch.h"
#include "shoal/memory/cpu_allocator.h"
#include "shoal/models/registry.h"
#include "shoal/parallel/data_parallel.h"
#include "shoal/parallel/distributed_data_parallel.h"

namespace shoal::cli {
namespace {

using Clock = std::chrono::steady_clock;


struct DpBenchArgs : StepBenchArgs, WorkerArgs {
  int replicas = 2;
  int batch = 128;  // global batch
  std::string torch_script = bench_script("dp_torch.py");
};

// Trains `steps` timed steps (after `warmup`) of `forward` on (x, y); returns the seconds.
template <typename Forward>
double timed_steps(const DpBenchArgs& args, torch::optim::Optimizer& optimizer, Forward forward,
                   const torch::Tensor& x, const torch::Tensor& y, double* optimizer_seconds,
                   const std::function<void()>& before_timing = nullptr) {
  auto step = [&](bool timed) {
    optimizer.zero_grad();
    torch::cross_entropy_loss(forward(x), y).backward();
    const auto t = Clock::now();
    optimizer.step();
    if (timed && optimizer_seconds != nullptr) *optimizer_seconds += seconds_since(t);
  };
  for (int i = 0; i < args.warmup; ++i) step(false);
  if (before_timing) before_timing();
  const auto start = Clock::now();
  for (int i = 0; i < args.steps; ++i) step(true);
  return seconds_since(start);
}

void run_worker(const DpBenchArgs& args) {
  memory::tune_cpu_allocator();
  compat::set_compute_threads(1);  // LibTorch's and OpenBLAS's pools: idle BLAS threads spin
  std::shared_ptr<models::Model> model = models::create(args.model, 0);
  const bool split = args.worker != "single" && args.worker != "shoal_dp";
  const int64_t batch = split ? args.batch / args.replicas : args.batch;
  torch::manual_seed(1 + (split ? args.rank : 0));
  auto x = torch::randn({batch, 1, 28, 28});
  auto y = torch::randint(0, 10, {batch}, torch::kLong);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  Values result;
  double optimizer_seconds = 0;
  if (args.worker == "single" || args.worker == "independent") {
    result["seconds"] = timed_steps(
        args, optimizer, [&](const torch::Tensor& in) { return model->forward(in); }, x, y,
        &optimizer_seconds);
  } else if (args.worker == "shoal_dp") {
    std::vector<int64_t> ids;
    for (int i = 0; i < args.replicas; ++i) ids.push_back(i);
    const std::string name = args.model;
    parallel::DataParallel<models::Model> dp(model, parallel::DataParallelOptions().device_ids(ids),
                                             [name] { return models::create(name, 0); });
    result["seconds"] = timed_steps(
        args, optimizer, [&](const torch::Tensor& in) { return dp.forward(in); }, x, y,
        &optimizer_seconds, [&] { dp.reset_stats(); });
    const parallel::DataParallelStats s = dp.stats();
    const double n = args.steps;
    result["scatter_ms"] = 1e3 * s.scatter_seconds / n;
    result["replicate_ms"] = 1e3 * s.replicate_seconds / n;
    result["forward_ms"] = 1e3 * s.forward_seconds / n;
    result["gather_ms"] = 1e3 * s.gather_seconds / n;
    result["backward_ms"] = 1e3 * s.backward_seconds / n;
    result["reduce_ms"] = 1e3 * s.reduce_seconds / n;
    result["slowest_replica_forward_ms"] =
        1e3 * *std::max_element(s.replica_forward_seconds.begin(), s.replica_forward_seconds.end()) / n;
    result["slowest_replica_backward_ms"] =
        1e3 * *std::max_element(s.replica_backward_seconds.begin(), s.replica_backward_seconds.end()) / n;
  } else if (args.worker == "shoal_ddp") {
    auto store = comm::make_file_store(args.store, args.replicas);
    auto group = comm::new_process_group("shm", store, args.rank, args.replicas);
    parallel::DistributedDataParallel<models::Model> ddp(model, group);
    result["seconds"] = timed_steps(
        args, optimizer, [&](const torch::Tensor& in) { return ddp.forward(in); }, x, y,
        &optimizer_seconds, [&] { group->barrier()->wait(); });
    group->barrier()->wait();
  } else {
    SHOAL_THROW(InvalidArgument, "bench dp: unknown worker '", args.worker, "'");
  }
  result["optimizer_ms"] = 1e3 * optimizer_seconds / args.steps;
  write_values(args.result, result, "bench dp");
}

// Runs the processes of one round of `mode`; true if every one exited 0.
bool run_together(const BenchMode& mode, const std::vector<ChildProcess>& children) {
  RunProcessesOptions options;
  options.benchmark = "bench dp";
  options.run = "the " + mode.name + " run";
  return run_processes(children, options) == 0;
}

void run_mode(const DpBenchArgs& args, const TempDir& dir, int round, BenchMode& mode) {
  // `words`, then what both sides are given.
  auto command = [&](std::vector<std::string> words) {
    words.insert(words.end(), {"--model", args.model, "--replicas", std::to_string(args.replicas),
                               "--batch", std::to_string(args.batch), "--steps",
                               std::to_string(args.steps), "--warmup", std::to_string(args.warmup)});
    return ChildProcess{words};
  };
  Values values;
  if (mode.name.rfind("pytorch_", 0) == 0) {
    const std::string result = dir.file(mode.name + ".json");
    const std::string python_mode = mode.name.substr(std::string("pytorch_").size());
    SHOAL_CHECK(run_together(mode, {command({"/usr/bin/python3", args.torch_script, "--mode",
                                              python_mode, "--result", result})}),
                "bench dp: the ", mode.name, " run failed (", args.torch_script, ")");
    values = read_json_numbers(result);
  } else {
    const int processes = mode.name == "independent" || mode.name == "shoal_ddp" ? args.replicas : 1;
    const std::string store = dir.file("store_" + std::to_string(round) + "_" + mode.name);
    std::vector<ChildProcess> ranks;
    for (int rank = 0; rank < processes; ++rank) {
      ranks.push_back(command({launcher::self_executable(), "bench", "dp", "--worker", mode.name,
                               "--rank", std::to_string(rank), "--store", store, "--result",
                               dir.file("rank" + std::to_string(rank))}));
    }
    SHOAL_CHECK(run_together(mode, ranks), "bench dp: the ", mode.name, " run failed");
    double seconds = 0;
    for (int rank = 0; rank < processes; ++rank) {
      Values r = read_values(dir.file("rank" + std::to_string(rank)));
      seconds = std::max(seconds, r["seconds"]);
      if (rank == 0) values = r;
    }
    const int64_t per_process = processes > 1 ? args.batch / args.replicas : args.batch;
    values["samples_per_s"] = processes * per_process * args.steps / seconds;
    values["step_ms"] = 1e3 * seconds / args.steps;
  }
  if (values.count("forward_ms") && !values.count("step_ms")) {
    values["step_ms"] = 1e3 * args.batch / values["samples_per_s"];
  }
  if (values.count("slowest_replica_forward_ms")) {
    double compute = values["slowest_replica_forward_ms"] + values["optimizer_ms"];
    // PyTorch's backward is one autograd pass over all replicas: count it whole.
    compute += values.count("slowest_replica_backward_ms") ? values["slowest_replica_backward_ms"]
                                                           : values["backward_ms"];
    values["overhead_ms"] = values["step_ms"] - compute;
  }
  for (const auto& [key, value] : values) mode.add(key, value);
}

// The per-step phases reported for the modes that time them, in the table's order.
const std::vector<std::string> kDpPhases{"scatter_ms", "replicate_ms", "forward_ms",
                                         "slowest_replica_forward_ms", "gather_ms", "backward_ms",
                                         "slowest_replica_backward_ms", "reduce_ms", "optimizer_ms",
                                         "step_ms", "overhead_ms"};

void print_dp_mode(const DpBenchArgs& args, const std::vector<BenchMode>& modes,
                   const BenchMode& mode) {
  const double single = modes[0].get("samples_per_s");
  const double ceiling = modes[1].get("samples_per_s");
  const double rate = mode.get("samples_per_s");
  if (args.json) {
    ReportLine line;
    line.add("mode", mode.name).add("model", args.model).add("replicas", args.replicas)
        .add("global_batch", args.batch).add("samples_per_s", rate, 2)
        .add("vs_single", rate / single, 3).add("of_ceiling", rate / ceiling, 3);
    for (const auto& p : kDpPhases) {
      if (std::isfinite(mode.get(p))) line.add(p, mode.get(p), 3);
    }
    line.add("rounds", args.rounds).print();
    return;
  }
  double pytorch_dp = std::nan("");
  for (const auto& m : modes) {
    if (m.name == "pytorch_dp") pytorch_dp = m.get("samples_per_s");
  }
  std::printf("%-18s %10.1f %8.2f %8.2f %8s\n", mode.name.c_str(), rate, rate / single,
              rate / ceiling,
              mode.name == "shoal_dp" && std::isfinite(pytorch_dp)
                  ? std::to_string(rate / pytorch_dp).substr(0, 5).c_str()
                  : "-");
}

void print_dp_phases(const std::vector<BenchMode>& modes) {
  std::printf("\nper-step phases, ms (forward/backward: wall of the parallel part; slowest: the "
              "slowest replica's own compute; overhead = step - slowest fwd - slowest bwd - opt)\n");
  std::printf("%-12s", "mode");
  for (const char* label : {"scatter", "replicate", "fwd_wall", "fwd_slow", "gather", "bwd_wall",
                            "bwd_slow", "reduce", "optim", "step", "overhead"}) {
    std::printf(" %9s", label);
  }
  std::printf("\n");
  for (const auto& mode : modes) {
    if (!std::isfinite(mode.get("forward_ms"))) continue;
    std::printf("%-12s", mode.name.c_str());
    for (const auto& p : kDpPhases) std::printf(" %9s", cell(mode.get(p), "%.2f").c_str());
    std::printf("\n");
  }
}

int run_dp_bench(const DpBenchArgs& args) {
  check_bench_model("bench dp", args.model);
  SHOAL_CHECK_T(InvalidArgument,
                args.replicas >= 2 && args.batch >= args.replicas && args.steps > 0 &&
                    args.rounds > 0,
                "bench dp: needs --replicas >= 2, --batch >= --replicas, positive --steps, --rounds");
  const bool have_torch =
      std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0;
  if (!have_torch) log::warn("bench dp: /usr/bin/python3 has no torch; PyTorch modes skipped");
  std::vector<BenchMode> modes{{"single"}, {"independent"}, {"shoal_dp"}, {"shoal_ddp"}};
  if (have_torch) {
    for (const char* name : {"pytorch_dp_module", "pytorch_dp", "pytorch_ddp"}) modes.push_back({name});
  }
  {
    const TempDir dir("dp");
    for (int round = 0; round < args.rounds; ++round) {
      for (size_t i : round_order(modes.size(), round)) run_mode(args, dir, round, modes[i]);
    }
  }
  if (!args.json) {
    std::printf("bench dp: model %s, global batch %d, %d replicas/ranks, %d steps, median of %d "
                "rounds\n%-18s %10s %8s %8s %8s\n",
                args.model.c_str(), args.batch, args.replicas, args.steps, args.rounds, "mode",
                "samples/s", "x single", "of_ceil", "vs_pt_dp");
  }
  for (const auto& mode : modes) print_dp_mode(args, modes, mode);
  if (!args.json) print_dp_phases(modes);
  return 0;
}

}  // namespace

void add_bench_dp_command(CLI::App& bench, std::vector<Command>& commands) {
  auto args = std::make_shared<DpBenchArgs>();
  auto* app = bench.add_subcommand(
      "dp", "DataParallel throughput: one thread vs Shoal DP vs DDP vs PyTorch's, side by side");
  add_step_options(*app, *args);
  app->add_option("--replicas", args->replicas, "DP replicas and DDP ranks")->capture_default_str();
  app->add_option("--batch", args->batch, "global batch per step")->capture_default_str();
  app->add_option("--torch-script", args->torch_script, "PyTorch peer script")->capture_default_str();
  add_worker_options(*app, *args);
  commands.push_back({app, [args] {
                        if (args->worker.empty()) return run_dp_bench(*args);
                        run_worker(*args);
                        return 0;
                      }});
}

}  // namespace shoal::cli
