// `shoal bench fsdp`: training throughput and memory per rank of Shoal's DDP and of
// FullyShardedDataParallel's three stages, beside PyTorch's DDP and PyTorch's
// ZeroRedundancyOptimizer (stage 1's peer; Debian's 1.13) and PyTorch 2.x's FSDP2 `fully_shard`
// (stages 2 and 3's peers; the wheel of scripts/setup_torch_pypi.sh, where it is installed), on
// the same model, batch and thread count.
//
// Modes, each `--world` fresh processes per round (one intra-op thread each, shm for Shoal, gloo
// for PyTorch, synthetic data, SGD with momentum): shoal_ddp, shoal_fsdp1/2/3, pytorch_ddp,
// pytorch_zero1, pytorch_fsdp2/3 (fully_shard with reshard_after_forward false/true: FSDP1's
// SHARD_GRAD_OP and FULL_SHARD). Rounds interleave the modes, and every mode runs between two
// shoal_ddp runs, so its ratio to DDP is taken per round against the DDP runs beside it (the
// machine's speed drifts within a minute); the report gives medians. Per mode:
// samples/s (all ranks), its ratio to shoal_ddp and to the PyTorch peer, peak RSS of the largest
// rank, and for Shoal the bytes a rank holds between steps for parameters, gradients and
// optimizer state (FSDP: memory_stats() plus the shards' momentum; DDP: parameters, gradients,
// momentum), the figure sharding divides.
#include <torch/torch.h>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
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
#include "shoal/memory/cpu_allocator.h"
#include "shoal/models/registry.h"
#include "shoal/parallel/distributed_data_parallel.h"
#include "shoal/parallel/fully_sharded_data_parallel.h"

namespace shoal::cli {
// Named, not anonymous: the CLI's sources are compiled in unity batches.
namespace bench_fsdp {

using Clock = std::chrono::steady_clock;

// Far above a normal run (a few seconds): only a hang reaches it.
constexpr std::chrono::seconds kRunDeadline{600};

struct FsdpBenchArgs : StepBenchArgs {
  FsdpBenchArgs() {
    steps = 20;
    warmup = 3;
  }
  int batch = 64;  ///< per rank
  int world = 2;
  std::string torch_script = bench_script("ddp_torch.py");
  /// debian: pytorch_ddp and pytorch_zero1; pypi (PyTorch 2.x): pytorch_fsdp2 and _fsdp3.
  std::vector<std::string> torch_peers{"debian", "pypi"};
};

struct Mode : BenchMode {
  const TorchPeer* peer = nullptr;  ///< the Python that runs a pytorch_ mode
  Mode(std::string mode_name, const TorchPeer* mode_peer = nullptr) : peer(mode_peer) {
    name = std::move(mode_name);
  }
};

int64_t tensor_bytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

int64_t momentum_bytes(torch::optim::Optimizer& optimizer) {
  int64_t bytes = 0;
  for (const auto& item : optimizer.state()) {
    if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(item.second.get())) {
      bytes += tensor_bytes(sgd->momentum_buffer());
    }
  }
  return bytes;
}

// What a rank holds between steps for parameters, gradients and optimizer state: FSDP's
// memory_stats() plus the shards' momentum; without FSDP, parameters, gradients and momentum.
int64_t held_bytes(models::Model& model, parallel::FullyShardedDataParallel* fsdp,
                   torch::optim::Optimizer& optimizer) {
  int64_t held = momentum_bytes(optimizer);
  if (!fsdp) {
    for (const auto& p : model.parameters()) held += tensor_bytes(p) + tensor_bytes(p.grad());
    return held;
  }
  const auto stats = fsdp->memory_stats();
  return held + stats.parameter_bytes + stats.gradient_bytes;
}

// One Shoal rank of `mode`: warmup, then timed steps; writes its numbers to `result`.
void run_rank(const FsdpBenchArgs& args, const std::string& mode, int rank,
              const std::string& store_path, const std::string& result) {
  compat::set_compute_threads(1);  // LibTorch's and OpenBLAS's pools: idle BLAS threads spin
  auto store = comm::make_file_store(store_path, args.world);
  auto group = comm::new_process_group("shm", store, rank, args.world);
  auto model = models::create(args.model, /*seed=*/0);
  std::shared_ptr<parallel::DistributedDataParallelBase> ddp;
  std::shared_ptr<parallel::FullyShardedDataParallel> fsdp;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  const auto sgd = torch::optim::SGDOptions(0.01).momentum(0.9);
  if (mode == "independent") {
    // The ceiling: the same training in every process, no communication (the group only lines
    // up the timed steps' start and end), with the allocator settings DDP and FSDP use.
    memory::tune_cpu_allocator();
    optimizer = std::make_unique<torch::optim::SGD>(model->parameters(), sgd);
  } else if (mode == "shoal_ddp") {
    ddp = std::make_shared<parallel::DistributedDataParallelBase>(model, group);
    optimizer = std::make_unique<torch::optim::SGD>(model->parameters(), sgd);
  } else {
    parallel::FullyShardedDataParallelOptions options;
    options.sharding_strategy = parallel::sharding_strategy_from_stage(mode.back() - '0');
    options.auto_wrap_min_num_params = 1;  // every layer a unit, as shoal train --strategy fsdp
    fsdp = std::make_shared<parallel::FullyShardedDataParallel>(model, group, options);
    optimizer = std::make_unique<torch::optim::SGD>(fsdp->parameters(), sgd);
  }
  torch::manual_seed(rank);
  const at::Tensor x = torch::randn({args.batch, 1, 28, 28});
  const at::Tensor y = torch::randint(0, 10, {args.batch});
  auto step = [&] {
    optimizer->zero_grad();
    at::Tensor out;
    if (!fsdp) {
      if (ddp) ddp->prepare_for_forward();
      out = model->forward(x);
      if (ddp) ddp->prepare_for_backward(out);
    } else {
      fsdp->prepare_for_forward();
      out = model->forward(x);
      fsdp->prepare_for_backward(out);
    }
    torch::nn::functional::cross_entropy(out, y).backward();
    optimizer->step();
  };
  for (int i = 0; i < args.warmup; ++i) step();
  group->barrier()->wait();
  const auto start = Clock::now();
  for (int i = 0; i < args.steps; ++i) step();
  const double seconds = seconds_since(start);
  const int64_t held = held_bytes(*model, fsdp.get(), *optimizer);
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  write_values(result,
               {{"seconds", seconds},
                {"held_mb", held / 1048576.0},
                {"peak_rss_mb", usage.ru_maxrss / 1024.0}},
               "bench fsdp");
}

void run_mode(const FsdpBenchArgs& args, const TempDir& dir, Mode& mode) {
  static int counter = 0;
  const std::string stem = dir.file("run" + std::to_string(counter++));
  RunProcessesOptions options;
  options.benchmark = "bench fsdp";
  options.run = "the " + mode.name + " run";
  options.deadline = kRunDeadline;
  const double samples = static_cast<double>(args.world) * args.batch * args.steps;
  if (mode.peer != nullptr) {
    std::vector<std::string> command = mode.peer->python;
    command.insert(command.end(), {args.torch_script, "--model", args.model, "--steps",
                                   std::to_string(args.steps), "--warmup",
                                   std::to_string(args.warmup), "--batch",
                                   std::to_string(args.batch), "--world",
                                   std::to_string(args.world), "--result", stem});
    if (mode.name == "pytorch_zero1") command.push_back("--zero");
    if (mode.name.rfind("pytorch_fsdp", 0) == 0) {
      command.insert(command.end(), {"--fsdp", std::string(1, mode.name.back())});
    }
    // PyTorch's gloo ranks abort now and then (about one run in twenty here, in 1.13's
    // ZeroRedundancyOptimizer and 2.15's fully_shard alike): one more try before giving up.
    if (run_processes({{command}}, options) != 0) {
      log::warn("bench fsdp: the ", mode.name, " run failed; trying it once more");
      SHOAL_CHECK(run_processes({{command}}, options) == 0, "bench fsdp: the ", mode.name,
                  " run failed twice (", args.torch_script, ")");
    }
    const Values values = read_json_numbers(stem);
    for (const std::string field : {"samples_per_s", "peak_rss_mb"}) {
      auto it = values.find(field);
      SHOAL_CHECK(it != values.end(), "bench fsdp: ", args.torch_script, " wrote no ", field);
      mode.add(field, it->second);
    }
    return;
  }
  const Values largest = run_forked_ranks(
      args.world, mode.name, stem,
      [&](int rank, const std::string& result) {
        run_rank(args, mode.name, rank, stem + ".store", result);
      },
      options);
  mode.add("samples_per_s", samples / largest.at("seconds"));
  mode.add("held_mb", largest.at("held_mb"));
  mode.add("peak_rss_mb", largest.at("peak_rss_mb"));
}

// The PyTorch peers asked for that can run their modes; each that cannot says so in one line.
std::vector<TorchPeer> fsdp_peers(const FsdpBenchArgs& args) {
  std::vector<TorchPeer> peers;
  for (const auto& name : args.torch_peers) {
    TorchPeer peer = find_torch_peer(name, "bench fsdp");
    if (!peer.available()) continue;
    if (name == "pypi" && std::atoi(peer.version.c_str()) < 2) {
      log::warn("bench fsdp: the pypi PyTorch is ", peer.version, ", not 2.x: no fully_shard; "
                "its modes are skipped");
      continue;
    }
    peers.push_back(peer);
  }
  return peers;
}

// The contenders: Shoal's DDP (the reference every other runs beside), the ceiling, Shoal's three
// stages, then each peer's modes.
std::vector<Mode> fsdp_contenders(const std::vector<TorchPeer>& peers) {
  std::vector<Mode> modes{{"shoal_ddp"}, {"independent"}, {"shoal_fsdp1"}, {"shoal_fsdp2"},
                          {"shoal_fsdp3"}};
  for (const auto& peer : peers) {
    // Debian's 1.13 cannot run FSDP under Python 3.11 (bench/ddp_torch.py --fsdp says why).
    const std::vector<std::string> names =
        peer.name == "pypi" ? std::vector<std::string>{"pytorch_fsdp2", "pytorch_fsdp3"}
                            : std::vector<std::string>{"pytorch_ddp", "pytorch_zero1"};
    for (const auto& name : names) modes.push_back({name, &peer});
  }
  return modes;
}

// This machine's speed swings by tens of percent within a minute, so every mode runs between two
// runs of Shoal's DDP (R A R B R ...): its ratio to DDP for a round is its rate over the mean of
// those two, and the median over the rounds is reported (vs_ddp). PyTorch's modes get the same
// ratio, so vs_pt = (Shoal's mode / DDP beside it) / (PyTorch's peer / DDP beside it).
void run_fsdp_rounds(const FsdpBenchArgs& args, std::vector<Mode>& modes) {
  const TempDir dir("fsdp");
  std::vector<BenchMode*> all;
  for (auto& mode : modes) all.push_back(&mode);
  run_rounds_beside_first(
      all, args.rounds, [&](BenchMode& mode) { run_mode(args, dir, static_cast<Mode&>(mode)); },
      "vs_ddp");
}

// The PyTorch peer of each Shoal mode.
std::string peer_mode(const std::string& name) {
  return name == "shoal_ddp"     ? "pytorch_ddp"
         : name == "shoal_fsdp1" ? "pytorch_zero1"
         : name == "shoal_fsdp2" ? "pytorch_fsdp2"
         : name == "shoal_fsdp3" ? "pytorch_fsdp3"
                                 : "";
}

// A mode's vs_ddp per round, by name; null when there is no such mode.
const std::vector<double>* vs_ddp_of(const std::vector<Mode>& modes, const std::string& name) {
  for (const auto& m : modes) {
    if (m.name == name) return &m.all("vs_ddp");
  }
  return nullptr;
}

// vs_pt: round by round, each against the DDP runs beside it; shoal_ddp against pytorch_ddp
// directly.
double vs_peer(const std::vector<Mode>& modes, const Mode& mode) {
  const std::string name = peer_mode(mode.name);
  const auto* peer = name.empty() ? nullptr : vs_ddp_of(modes, name);
  if (!peer) return NAN;
  const auto& mine = mode.all("vs_ddp");
  std::vector<double> per_round;
  for (size_t k = 0; k < peer->size(); ++k) {
    per_round.push_back((mode.name == "shoal_ddp" ? 1.0 : mine.at(k)) / peer->at(k));
  }
  return median(per_round);
}

void print_fsdp_mode(const FsdpBenchArgs& args, const std::vector<Mode>& modes, const Mode& mode) {
  const double rate = mode.get("samples_per_s");
  const double vs_pt = vs_peer(modes, mode);
  const double vs_ddp = mode.get("vs_ddp");
  const auto& each = mode.all("vs_ddp");
  const auto [low, high] = std::minmax_element(each.begin(), each.end());
  if (args.json) {
    ReportLine()
        .add("bench", "fsdp").add("model", args.model).add("mode", mode.name)
        .add("world", args.world).add("batch", args.batch).add("samples_per_s", rate)
        .add("vs_shoal_ddp", vs_ddp).add("vs_shoal_ddp_min", *low).add("vs_shoal_ddp_max", *high)
        .add("vs_pytorch", vs_pt).add("held_mb", mode.get("held_mb"))
        .add("peak_rss_mb", mode.get("peak_rss_mb")).add("rounds", args.rounds)
        .print();
    return;
  }
  std::printf("%-16s %10.1f %8s %13s %8s %9s %9.1f\n", mode.name.c_str(), rate,
              cell(vs_ddp, "%.3f").c_str(),
              mode.name == "shoal_ddp" ? "-" : (cell(*low, "%.2f") + "-" + cell(*high, "%.2f")).c_str(),
              cell(vs_pt, "%.3f").c_str(), cell(mode.get("held_mb"), "%.2f").c_str(),
              mode.get("peak_rss_mb"));
}

// The floor the machine sets on vs_pt: DDP cannot beat `independent` (the same processes without
// communication), so against a PyTorch peer it cannot exceed the ceiling's ratio to that peer
// (round by round, each against the DDP runs beside it). The sharded stages can edge past it:
// their optimizer steps only a shard.
void print_ceiling_over_peers(const FsdpBenchArgs& args, const std::vector<Mode>& modes) {
  const auto* ceiling = vs_ddp_of(modes, "independent");
  if (!ceiling) return;
  for (const auto& m : modes) {
    if (m.peer == nullptr) continue;
    const double ratio = median_ratio(*ceiling, m.all("vs_ddp"));
    if (args.json) {
      ReportLine().add("bench", "fsdp").add("model", args.model).add("ceiling_over", m.name)
          .add("ratio", ratio).print();
    } else {
      std::printf("ceiling: independent / %s = %.3f (the most DDP can reach against it; the "
                  "sharded stages step only a shard, so they may edge past it)\n",
                  m.name.c_str(), ratio);
    }
  }
}

void print_fsdp_header(const FsdpBenchArgs& args, const std::vector<TorchPeer>& peers) {
  std::string beside;
  for (const auto& peer : peers) beside += (beside.empty() ? ", beside " : " and ") + peer.label();
  std::printf("bench fsdp: model %s, %d ranks x batch %d, %d steps, SGD momentum, median of %d "
              "rounds%s\n",
              args.model.c_str(), args.world, args.batch, args.steps, args.rounds, beside.c_str());
  std::printf("%-16s %10s %8s %13s %8s %9s %9s\n", "mode", "samples/s", "vs_ddp", "vs_ddp range",
              "vs_pt", "held MB", "peak MB");
}

void print_fsdp_legend(const std::vector<Mode>& modes) {
  std::printf("independent = the same processes training without communication (the machine's "
              "ceiling for data parallelism); "
              "vs_ddp = samples/s / the mean of the two shoal_ddp runs beside it (every mode "
              "runs between two), median over the rounds (range: lowest-highest round); "
              "vs_pt = the same ratio of shoal_ddp / pytorch_ddp, shoal_fsdp1 / pytorch_zero1 "
              "(ZeroRedundancyOptimizer) and shoal_fsdp2|3 / pytorch_fsdp2|3 (2.x fully_shard, "
              "reshard_after_forward false|true), round by round; samples/s: medians (shoal_ddp "
              "over its %zu runs); held MB = parameters + gradients + optimizer state a rank "
              "holds between steps\n",
              modes[0].all("samples_per_s").size());
}

int run_fsdp_bench(const FsdpBenchArgs& args) {
  SHOAL_CHECK_T(InvalidArgument, args.world >= 2 && args.batch >= 1 && args.steps >= 1 &&
                                     args.rounds >= 1,
                "bench fsdp: needs --world >= 2 and positive --batch, --steps and --rounds");
  const std::vector<TorchPeer> peers = fsdp_peers(args);
  std::vector<Mode> modes = fsdp_contenders(peers);
  run_fsdp_rounds(args, modes);
  if (!args.json) print_fsdp_header(args, peers);
  for (const auto& mode : modes) print_fsdp_mode(args, modes, mode);
  print_ceiling_over_peers(args, modes);
  if (!args.json) print_fsdp_legend(modes);
  return 0;
}

}  // namespace bench_fsdp

void add_bench_fsdp_command(CLI::App& bench, std::vector<Command>& commands) {
  auto args = std::make_shared<bench_fsdp::FsdpBenchArgs>();
  auto* app = bench.add_subcommand(
      "fsdp", "FullyShardedDataParallel stages 1-3 vs Shoal's DDP, PyTorch's DDP and "
              "ZeroRedundancyOptimizer (1.13) and fully_shard (2.x): samples/s and memory per "
              "rank");
  add_step_options(*app, *args);
  app->add_option("--batch", args->batch, "Samples per rank and step")->capture_default_str();
  app->add_option("--world", args->world, "Ranks")->capture_default_str();
  app->add_option("--torch-script", args->torch_script, "PyTorch peer script")->capture_default_str();
  add_torch_option(*app, args->torch_peers);
  commands.push_back({app, [args] { return bench_fsdp::run_fsdp_bench(*args); }});
}

}  // namespace shoal::cli
