// `shoal bench ps`: the parameter server against DDP on the same model, workers and machine.
//
// Part 1, throughput: `shoal train` is run as fresh processes for --strategy ddp and for
// --strategy ps under bsp, asp and ssp (same model, workers, batch, samples, one thread per
// process) and each epoch's samples/s is read from its metrics file. bsp does DDP's math, but
// every step sends all gradients to the servers and all parameters back through them (2x the
// model per worker per step over TCP, serialized at the servers), where DDP's shared-memory
// allreduce moves each byte once between peers and overlaps it with backward; so bsp is expected
// to be slower, and the ratio says by how much.
//
// Part 2, time to accuracy with one worker slowed 2x (the case asynchrony is for): servers and
// workers are threads of this process; a slowed step sleeps as long as it took to compute. Every
// mode trains for the same wall time; worker 0 keeps a timestamped copy of its weights every few
// steps, evaluated afterwards on the test set (so evaluation costs training nothing), and the
// report gives the first time each mode reached --target, the median over --rounds rounds that
// interleave the modes. Two straggler patterns:
// - persistent: the last worker is slowed on every step. asp gains (the fast worker never
//   waits); ssp cannot, by construction: once the fast worker is s clocks ahead it waits for the
//   slow one, so its long-run pace is the slow worker's, as under bsp.
// - rotating: at any moment one worker is slowed, a different one every --straggler-phase of its
//   steps (transient stragglers, as on a shared cluster). bsp runs every step at the slow pace,
//   since some worker is always slow; ssp absorbs a phase's lag within its bound s and runs at
//   the workers' mean pace (Ho et al., 2013).
#include <unistd.h>

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <mutex>
#include <regex>
#include <sstream>
#include <thread>

#include "bench_harness.h"
#include "bench_util.h"
#include "commands.h"
#include "compat/thread_parallelism.h"
#include "shoal/data/fashion_mnist.h"
#include "shoal/error.h"
#include "shoal/launcher/launch.h"
#include "shoal/models/registry.h"
#include "shoal/ps/server.h"
#include "shoal/ps/worker.h"
#include "shoal/train/trainer.h"

namespace shoal::cli {
namespace {

using Clock = std::chrono::steady_clock;

// How long one `shoal train` run of part 1 may take before it is killed: one epoch of the default
// 12000 samples takes seconds, of all 60000 with the cnn a few minutes; only a hang hits this.
constexpr std::chrono::seconds kTrainDeadline{1800};

struct PsBenchArgs {
  std::string model = "mlp";
  int workers = 2;
  int servers = 1;
  int staleness = 2;
  int batch = 64;
  int64_t train_samples = 12000;
  // Why lr 0.2, no momentum and target 0.82 (MLP): asynchrony adds momentum of its own
  // (Mitliagkas et al., 2016), so server momentum makes stale updates overshoot. At momentum 0.9
  // asp reached 0.82 at 0.71x bsp's speed (persistent straggler); at lr 0.1, momentum 0.5 asp
  // 1.33-1.54x, ssp 0.87-0.90x; at lr 0.2 (the same effective step) plain SGD asp 1.65x, ssp
  // 1.07x, and with the rotating straggler asp 1.36x, ssp 1.21x (docs/PERFORMANCE.md, 2026-12-03).
  // A target reached in the first seconds (0.78: ~40 bsp steps) measures the start-up transient,
  // not the pace that a straggler sets. Every mode runs with the same settings.
  double lr = 0.2;
  double momentum = 0.0;
  double target = 0.82;
  double seconds = 20;
  int rounds = 3;
  std::string straggler = "both";  // persistent, rotating or both
  int straggler_phase = 2;         // rotating: steps of one worker's slow phase
  bool json = false;
  bool skip_throughput = false;
};

void report(const PsBenchArgs& args, const ReportLine& line, const std::string& text) {
  if (args.json) {
    std::printf("%s\n", line.str().c_str());
  } else {
    std::printf("%s\n", text.c_str());
  }
  std::fflush(stdout);
}

// samples/s of one `shoal train` run (its first epoch), or -1 when it failed.
double train_throughput(const PsBenchArgs& args, const std::vector<std::string>& strategy_args) {
  const TempDir dir("ps");
  const std::string metrics = dir.file("metrics.jsonl");
  ChildProcess train;
  train.argv = {launcher::self_executable(), "train"};
  train.argv.insert(train.argv.end(), strategy_args.begin(), strategy_args.end());
  train.argv.insert(train.argv.end(),
                    {"--model", args.model, "--epochs", "1", "--train-samples",
                     std::to_string(args.train_samples), "--test-samples", "1000", "--batch-size",
                     std::to_string(args.batch), "--lr", std::to_string(args.lr), "--momentum",
                     std::to_string(args.momentum), "--threads", "1", "--no-progress",
                     "--log-interval", "0", "--metrics", metrics});
  train.quiet = true;
  RunProcessesOptions options;
  options.benchmark = "bench ps";
  options.run = "shoal train " + strategy_args.at(0) + " " + strategy_args.at(1);
  options.deadline = kTrainDeadline;
  if (run_processes({train}, options) != 0) return -1;
  std::ifstream in(metrics);
  std::stringstream text;
  text << in.rdbuf();
  std::smatch match;
  const std::string all = text.str();
  if (!std::regex_search(all, match, std::regex("\"samples_per_s\":\\s*([0-9.eE+-]+)"))) return -1;
  return std::stod(match[1]);
}

struct Snapshot {
  double seconds;
  std::vector<at::Tensor> weights;
};

// Whether worker `rank`'s step `step` is slowed under the pattern (see the file comment).
bool is_slowed(const PsBenchArgs& args, bool rotating, int rank, int64_t step) {
  if (!rotating) return rank == args.workers - 1;
  return (step / args.straggler_phase) % args.workers == rank;
}

// The servers of one time-to-accuracy run, started, and their endpoints.
struct Servers {
  std::vector<std::unique_ptr<ps::Server>> servers;
  std::vector<std::string> endpoints;
};

Servers start_servers(const PsBenchArgs& args, ps::Consistency consistency) {
  ps::ServerOptions options;
  options.num_workers = args.workers;
  options.consistency = consistency;
  options.staleness = args.staleness;
  options.optimizer = std::make_shared<ps::Sgd>(ps::SgdOptions{args.lr, args.momentum});
  options.verbose = false;
  Servers started;
  for (int s = 0; s < args.servers; ++s) {
    options.rank = s;
    started.servers.push_back(std::make_unique<ps::Server>(options));
    started.endpoints.push_back(started.servers.back()->endpoint());
    started.servers.back()->start();
  }
  return started;
}

// What the worker threads of one time-to-accuracy run share.
struct SlowedRun {
  const PsBenchArgs& args;
  bool rotating;
  const train::TensorData& train_data;
  std::vector<std::string> endpoints;
  Clock::time_point start = Clock::now();
  std::atomic<bool> stop{false};
  std::atomic<int64_t> steps{0};
  std::mutex snapshot_mutex;
  std::vector<Snapshot> snapshots;  // worker 0's
};

// Worker `rank` of `run`, until run.stop: its share of the batches, slowed as the pattern says;
// worker 0 keeps a snapshot of its weights every 5 steps.
void run_slowed_worker(SlowedRun& run, int rank) {
  const PsBenchArgs& args = run.args;
  auto model = models::create(args.model, /*seed=*/0);
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& item : model->named_parameters()) named.emplace_back(item.key(), item.value());
  ps::WorkerOptions wo;
  wo.servers = run.endpoints;
  wo.rank = rank;
  wo.num_workers = args.workers;
  ps::Worker worker(wo, named);
  worker.init();
  const int64_t n = run.train_data.size();
  const at::Tensor order = train::shuffled_indices(n, 0, 0);
  int64_t position = rank * args.batch;
  for (int64_t step = 0; !run.stop.load(); ++step) {
    const bool slowed = is_slowed(args, run.rotating, rank, step);
    if (position + args.batch > n) position = rank * args.batch;
    const at::Tensor idx = order.slice(0, position, position + args.batch);
    position += int64_t{args.batch} * args.workers;
    const Clock::time_point compute_start = Clock::now();
    model->zero_grad();
    torch::nn::functional::cross_entropy(model->forward(run.train_data.inputs.index_select(0, idx)),
                                         run.train_data.targets.index_select(0, idx))
        .backward();
    if (slowed) std::this_thread::sleep_for(Clock::now() - compute_start);
    worker.step();
    ++run.steps;
    if (rank == 0 && step % 5 == 0) {
      Snapshot snap;
      snap.seconds = std::chrono::duration<double>(Clock::now() - run.start).count();
      for (const auto& p : model->parameters()) snap.weights.push_back(p.detach().clone());
      std::lock_guard<std::mutex> lock(run.snapshot_mutex);
      run.snapshots.push_back(std::move(snap));
    }
  }
  worker.close();
}

// Trains for args.seconds with stragglers as `rotating` says; returns worker 0's snapshots.
std::vector<Snapshot> train_slowed(const PsBenchArgs& args, ps::Consistency consistency,
                                   bool rotating, const train::TensorData& train_data,
                                   int64_t* total_steps) {
  Servers servers = start_servers(args, consistency);
  SlowedRun run{args, rotating, train_data, servers.endpoints};
  std::vector<std::string> errors(static_cast<size_t>(args.workers));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < args.workers; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        run_slowed_worker(run, rank);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(rank)] = e.what();
        run.stop.store(true);
      }
    });
  }
  while (!run.stop.load() && seconds_since(run.start) < args.seconds) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  run.stop.store(true);
  for (auto& t : threads) t.join();
  for (auto& s : servers.servers) s->join();
  for (const std::string& e : errors) SHOAL_CHECK(e.empty(), "bench ps: ", e);
  *total_steps = run.steps.load();
  return std::move(run.snapshots);
}

// The first time worker 0's snapshots reached args.target on the test set (+inf when none did);
// `best` gets the best accuracy seen up to then.
double time_to_target(const PsBenchArgs& args, const std::vector<Snapshot>& snapshots,
                      const train::TensorData& test_data, double* best) {
  auto model = models::create(args.model, 0);
  *best = 0;
  for (const Snapshot& snap : snapshots) {
    {
      torch::NoGradGuard no_grad;
      auto params = model->parameters();
      for (size_t i = 0; i < params.size(); ++i) params[i].copy_(snap.weights[i]);
    }
    const train::EvalResult eval = train::evaluate(
        *model, [&](const at::Tensor& x) { return model->forward(x); }, test_data, 500);
    *best = std::max(*best, eval.accuracy);
    if (eval.accuracy >= args.target) return snap.seconds;
  }
  return std::numeric_limits<double>::infinity();
}

std::string seconds_list(const std::vector<double>& values) {
  std::string text;
  for (const double v : values) {
    char one[32] = "-";  // not reached
    if (std::isfinite(v)) std::snprintf(one, sizeof(one), "%.2f", v);
    text += (text.empty() ? "" : " ") + std::string(one);
  }
  return text;
}

// Part 2 for one straggler pattern: each mode's time to args.target, over args.rounds rounds that
// interleave the modes (bsp asp ssp bsp asp ssp ...: the machine's slow phases fall on all of
// them); the median time and the median of the rounds' ratios to bsp are reported. One round's
// first crossing of the target is noisy (one run measured asp at 0.89x bsp, the next at 1.54x).
void report_time_to_accuracy(const PsBenchArgs& args, bool rotating,
                             const train::TensorData& train_data,
                             const train::TensorData& test_data) {
  const std::string pattern = rotating ? "rotating" : "persistent";
  const std::vector<ps::Consistency> modes{ps::Consistency::kBsp, ps::Consistency::kAsp,
                                           ps::Consistency::kSsp};
  std::vector<std::vector<double>> times(modes.size()), bests(modes.size()), steps(modes.size());
  for (int round = 0; round < args.rounds; ++round) {
    for (size_t m = 0; m < modes.size(); ++m) {
      int64_t total_steps = 0;
      const std::vector<Snapshot> snapshots =
          train_slowed(args, modes[m], rotating, train_data, &total_steps);
      double best = 0;
      times[m].push_back(time_to_target(args, snapshots, test_data, &best));
      bests[m].push_back(best);
      steps[m].push_back(static_cast<double>(total_steps));
    }
  }
  for (size_t m = 0; m < modes.size(); ++m) {
    // Per round, bsp's time over this mode's: > 1 is faster than bsp; a mode that never reached
    // the target counts as 0, a round where neither did is left out.
    std::vector<double> ratios;
    for (int r = 0; r < args.rounds; ++r) {
      const double bsp = times[0][static_cast<size_t>(r)];
      const double mine = times[m][static_cast<size_t>(r)];
      if (std::isfinite(mine)) {
        ratios.push_back(bsp / mine);
      } else if (std::isfinite(bsp)) {
        ratios.push_back(0);
      }
    }
    const double seconds = median(times[m]);
    const double speedup = median(ratios);
    const char* name = ps::consistency_name(modes[m]);
    report(args,
           ReportLine()
               .add("part", "time_to_accuracy")
               .add("straggler", pattern)
               .add("mode", name)
               .add("target", args.target)
               .add("rounds", args.rounds)
               .add("seconds", std::isfinite(seconds) ? seconds : -1.0)
               .add("best_accuracy", median(bests[m]))
               .add("steps", median(steps[m]))
               .add("speedup_vs_bsp", std::isfinite(speedup) ? speedup : 0.0),
           std::string("time to ") + std::to_string(args.target) + "  " + pattern +
               " straggler  " + name + "  median " +
               (std::isfinite(seconds) ? std::to_string(seconds) + " s" : "not reached") +
               " (rounds: " + seconds_list(times[m]) + " s; median " +
               std::to_string(static_cast<int64_t>(median(steps[m]))) + " steps in " +
               std::to_string(static_cast<int>(args.seconds)) + " s" +
               (m > 0 && std::isfinite(speedup)
                    ? "; " + std::to_string(speedup) + " x bsp's speed, median of the rounds)"
                    : ")"));
  }
}

int run_bench_ps(const PsBenchArgs& args) {
  compat::set_compute_threads(1);  // LibTorch's and OpenBLAS's pools: idle BLAS threads spin
  if (!args.skip_throughput) {
    const double ddp = train_throughput(
        args, {"--strategy", "ddp", "--nproc-per-node", std::to_string(args.workers)});
    report(args, ReportLine().add("part", "throughput").add("mode", "ddp").add("samples_per_s", ddp),
           "throughput  ddp  " + std::to_string(ddp) + " samples/s");
    for (const char* mode : {"bsp", "asp", "ssp"}) {
      const double rate = train_throughput(
          args, {"--strategy", "ps", "--consistency", mode, "--staleness",
                 std::to_string(args.staleness), "--workers", std::to_string(args.workers),
                 "--servers", std::to_string(args.servers)});
      report(args,
             ReportLine()
                 .add("part", "throughput")
                 .add("mode", mode)
                 .add("samples_per_s", rate)
                 .add("vs_ddp", ddp > 0 ? rate / ddp : 0.0),
             std::string("throughput  ") + mode + "  " + std::to_string(rate) + " samples/s (" +
                 std::to_string(ddp > 0 ? rate / ddp : 0.0) + " x ddp)");
    }
  }

  const data::FashionMnist train_set(data::FashionMnist::kDefaultRoot, /*train=*/true);
  const data::FashionMnist test_set(data::FashionMnist::kDefaultRoot, /*train=*/false);
  const int64_t n = std::min<int64_t>(args.train_samples, train_set.images().size(0));
  const train::TensorData train_data{train_set.images().slice(0, 0, n),
                                     train_set.targets().slice(0, 0, n)};
  const train::TensorData test_data{test_set.images().slice(0, 0, 2000),
                                    test_set.targets().slice(0, 0, 2000)};
  if (args.straggler != "rotating") report_time_to_accuracy(args, false, train_data, test_data);
  if (args.straggler != "persistent") report_time_to_accuracy(args, true, train_data, test_data);
  return 0;
}

}  // namespace

void add_bench_ps_command(CLI::App& bench, std::vector<Command>& commands) {
  auto args = std::make_shared<PsBenchArgs>();
  auto* app = bench.add_subcommand(
      "ps", "Parameter server: samples/s of bsp/asp/ssp vs DDP, and time to accuracy with one "
            "worker slowed 2x");
  app->add_option("--model", args->model, "mlp or cnn")->capture_default_str();
  app->add_option("--workers", args->workers, "worker processes/threads")->capture_default_str();
  app->add_option("--servers", args->servers, "parameter servers")->capture_default_str();
  app->add_option("--staleness", args->staleness, "ssp's bound")->capture_default_str();
  app->add_option("--batch", args->batch, "batch per worker")->capture_default_str();
  app->add_option("--train-samples", args->train_samples, "training images used")
      ->capture_default_str();
  app->add_option("--lr", args->lr, "SGD learning rate")->capture_default_str();
  app->add_option("--momentum", args->momentum, "SGD momentum")->capture_default_str();
  app->add_option("--target", args->target, "test accuracy to reach (part 2)")
      ->capture_default_str();
  app->add_option("--seconds", args->seconds, "training time per mode (part 2)")
      ->capture_default_str();
  app->add_option("--straggler", args->straggler,
                  "part 2: persistent (the last worker slowed on every step), rotating (one\n"
                  "worker at a time, a different one every --straggler-phase steps), or both")
      ->check(CLI::IsMember({"persistent", "rotating", "both"}))
      ->capture_default_str();
  app->add_option("--straggler-phase", args->straggler_phase,
                  "rotating: steps of each worker's slow phase")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--rounds", args->rounds, "rounds interleaving the modes (part 2); medians")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  app->add_flag("--skip-throughput", args->skip_throughput, "only part 2");
  app->add_flag("--json", args->json, "one JSON object per line");
  commands.push_back({app, [args] { return run_bench_ps(*args); }});
}

}  // namespace shoal::cli
