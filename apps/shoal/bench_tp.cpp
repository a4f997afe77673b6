// `shoal bench tp`: tensor parallelism's training throughput and memory per rank on the built-in
// GPT, beside one process, Shoal's DDP on the same global batch, and PyTorch 2.x's tensor
// parallelism (bench/tp_torch.py on the wheel of scripts/setup_torch_pypi.sh, where installed).
//
// Modes, fresh processes per run (one intra-op and one BLAS thread each, shm, random token
// blocks, SGD with momentum): `single` (one process, the whole global batch), `shoal_ddp` (--world
// ranks, each 1/world of the batch) and `shoal_tp` (--world ranks in one tensor-parallel group,
// each the whole batch through its shard of the model: Model::parallelize), and `pytorch_tp` (the
// same plan with parallelize_module and loss_parallel, gloo). Every step of every mode trains on
// --world x --batch blocks, so samples/s compare directly. Every mode runs between two shoal_ddp
// runs (this machine's speed drifts within a minute): vs_ddp is a run's rate over the mean of the
// two beside it, median over the rounds. held MB is what a rank keeps between steps (parameters,
// gradients, momentum): the figure tensor parallelism divides. vs_pt is shoal_tp's vs_ddp over
// pytorch_tp's, round by round.
#include <torch/torch.h>

#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <chrono>
#include <cstdio>
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
#include "shoal/models/gpt.h"
#include "shoal/parallel/distributed_data_parallel.h"
#include "shoal/parallel/tensor_parallel.h"
#include "shoal/train/clip_grad.h"

namespace shoal::cli {
// Named, not anonymous: the CLI's sources are compiled in unity batches.
namespace bench_tp {

// Far above a normal run (seconds): only a hang reaches it.
constexpr std::chrono::seconds kRunDeadline{600};

struct TpBenchArgs : StepBenchArgs {
  TpBenchArgs() {
    model = "gpt";
    steps = 10;
    warmup = 2;
  }
  int batch = 4;  ///< blocks per rank and step under DDP; the global batch is world x batch
  int world = 2;
  models::GptConfig gpt;
  std::string torch_script = bench_script("tp_torch.py");
  std::vector<std::string> torch_peers{"pypi"};
};

int64_t tensor_bytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

// Parameters (each once: the tied head is the embedding), their gradients and SGD's momentum.
int64_t held_bytes(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  int64_t held = 0;
  for (const auto& p : optimizer.param_groups().front().params()) {
    held += tensor_bytes(p) + tensor_bytes(p.grad());
  }
  for (const auto& item : optimizer.state()) {
    if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(item.second.get())) {
      held += tensor_bytes(sgd->momentum_buffer());
    }
  }
  return held;
}

// One rank of `mode` (`ranks` of them): warmup, then timed steps; writes its numbers to `result`.
void run_rank(const TpBenchArgs& args, const std::string& mode, int rank, int ranks,
              const std::string& store_path, const std::string& result) {
  // OpenBLAS's own pool too: its idle threads spin after each product, and two ranks' spinning
  // threads took half the cores (a rank's CPU time per step doubled). PyTorch's
  // torch.set_num_threads(1) sets MKL's, the peer's BLAS, as well.
  compat::set_compute_threads(1);
  torch::manual_seed(0);
  auto model = std::make_shared<models::Gpt>(args.gpt);
  std::shared_ptr<comm::ProcessGroup> group;
  if (ranks > 1) {
    group = comm::new_process_group("shm", comm::make_file_store(store_path, ranks), rank, ranks);
  }
  std::unique_ptr<parallel::TensorParallelLayout> layout;
  std::shared_ptr<parallel::DistributedDataParallelBase> ddp;
  if (mode == "shoal_tp") {
    layout = std::make_unique<parallel::TensorParallelLayout>(model->parallelize(group));
  } else if (mode == "shoal_ddp") {
    ddp = std::make_shared<parallel::DistributedDataParallelBase>(model, group);
  }
  torch::optim::SGD optimizer(train::unique_parameters(model->parameters()), torch::optim::SGDOptions(0.01).momentum(0.9));
  // DDP's ranks each take their slice of the global batch; the others all of it (TP's ranks
  // compute the same samples, each through its shard).
  const int64_t rows = ddp ? args.batch : int64_t{args.batch} * args.world;
  torch::manual_seed(rank);
  const auto vocab = args.gpt.vocab_size;
  const at::Tensor x = torch::randint(0, vocab, {rows, args.gpt.block_size}, torch::kLong);
  const at::Tensor y = torch::randint(0, vocab, {rows, args.gpt.block_size}, torch::kLong);
  auto step = [&] {
    optimizer.zero_grad();
    if (ddp) ddp->prepare_for_forward();
    model->forward_loss(x, y).backward();
    optimizer.step();
  };
  for (int i = 0; i < args.warmup; ++i) step();
  if (group) group->barrier()->wait();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < args.steps; ++i) step();
  const double seconds = seconds_since(start);
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  write_values(result,
               {{"seconds", seconds},
                {"held_mb", held_bytes(*model, optimizer) / 1048576.0},
                {"peak_rss_mb", usage.ru_maxrss / 1024.0}},
               "bench tp");
}

struct Mode : BenchMode {
  const TorchPeer* peer = nullptr;  ///< the Python that runs pytorch_tp
  explicit Mode(std::string mode_name, const TorchPeer* mode_peer = nullptr) : peer(mode_peer) {
    name = std::move(mode_name);
  }
  int ranks(const TpBenchArgs& args) const { return name == "single" ? 1 : args.world; }
};

// --model gpt's sizes, as `shoal train --model gpt` and bench/tp_torch.py take them.
std::vector<std::string> gpt_flags(const models::GptConfig& gpt) {
  return {"--n-layer",    std::to_string(gpt.n_layer),    "--n-head",
          std::to_string(gpt.n_head),                     "--n-embd",
          std::to_string(gpt.n_embd),                     "--block-size",
          std::to_string(gpt.block_size),                 "--vocab-size",
          std::to_string(gpt.vocab_size)};
}

void run_pytorch_mode(const TpBenchArgs& args, const std::string& stem, Mode& mode,
                      const RunProcessesOptions& options) {
  std::vector<std::string> command = mode.peer->python;
  command.insert(command.end(), {args.torch_script, "--steps", std::to_string(args.steps),
                                 "--warmup", std::to_string(args.warmup), "--batch",
                                 std::to_string(args.batch), "--world", std::to_string(args.world),
                                 "--result", stem});
  for (auto& word : gpt_flags(args.gpt)) command.push_back(word);
  SHOAL_CHECK(run_processes({{command}}, options) == 0, "bench tp: the ", mode.name,
              " run failed (", args.torch_script, ")");
  const Values values = read_json_numbers(stem);
  for (const std::string field : {"samples_per_s", "held_mb", "peak_rss_mb"}) {
    auto it = values.find(field);
    SHOAL_CHECK(it != values.end(), "bench tp: ", args.torch_script, " wrote no ", field);
    mode.add(field, it->second);
  }
}

void run_mode(const TpBenchArgs& args, const TempDir& dir, Mode& mode) {
  static int counter = 0;
  const std::string stem = dir.file("run" + std::to_string(counter++));
  RunProcessesOptions options;
  options.benchmark = "bench tp";
  options.run = "the " + mode.name + " run";
  options.deadline = kRunDeadline;
  if (mode.peer != nullptr) return run_pytorch_mode(args, stem, mode, options);
  const int ranks = mode.ranks(args);
  const Values largest = run_forked_ranks(
      ranks, mode.name, stem,
      [&](int rank, const std::string& result) {
        run_rank(args, mode.name, rank, ranks, stem + ".store", result);
      },
      options);
  const double samples = static_cast<double>(args.world) * args.batch * args.steps;
  mode.add("samples_per_s", samples / largest.at("seconds"));
  mode.add("held_mb", largest.at("held_mb"));
  mode.add("peak_rss_mb", largest.at("peak_rss_mb"));
}

// shoal_tp's vs_ddp over pytorch_tp's, round by round (each against the DDP runs beside it).
double vs_peer(const std::vector<Mode>& modes, const Mode& mode) {
  if (mode.name != "shoal_tp") return NAN;
  for (const auto& peer : modes) {
    if (peer.name == "pytorch_tp") return median_ratio(mode.all("vs_ddp"), peer.all("vs_ddp"));
  }
  return NAN;
}

void print_mode(const TpBenchArgs& args, const std::vector<Mode>& modes, const Mode& mode) {
  const double vs_pt = vs_peer(modes, mode);
  const auto& each = mode.all("vs_ddp");
  const auto [low, high] = std::minmax_element(each.begin(), each.end());
  if (args.json) {
    ReportLine()
        .add("bench", "tp").add("model", "gpt").add("mode", mode.name)
        .add("ranks", mode.ranks(args)).add("global_batch", args.world * args.batch)
        .add("samples_per_s", mode.get("samples_per_s")).add("vs_shoal_ddp", mode.get("vs_ddp"))
        .add("vs_shoal_ddp_min", *low).add("vs_shoal_ddp_max", *high).add("vs_pytorch", vs_pt)
        .add("held_mb", mode.get("held_mb")).add("peak_rss_mb", mode.get("peak_rss_mb"))
        .add("rounds", args.rounds)
        .print();
    return;
  }
  std::printf("%-10s %5d %10.2f %8s %13s %8s %9.2f %9.1f\n", mode.name.c_str(), mode.ranks(args),
              mode.get("samples_per_s"), cell(mode.get("vs_ddp"), "%.3f").c_str(),
              mode.name == "shoal_ddp" ? "-" : (cell(*low, "%.2f") + "-" + cell(*high, "%.2f")).c_str(),
              cell(vs_pt, "%.3f").c_str(), mode.get("held_mb"), mode.get("peak_rss_mb"));
}

int run_tp_bench(const TpBenchArgs& args) {
  SHOAL_CHECK_T(InvalidArgument, args.world >= 2 && args.batch >= 1 && args.steps >= 1 &&
                                     args.rounds >= 1,
                "bench tp: needs --world >= 2 and positive --batch, --steps and --rounds");
  check_bench_model("bench tp", args.model, {"gpt"});
  SHOAL_CHECK_T(InvalidArgument, args.model == "gpt", "bench tp: --model gpt is the model it splits");
  args.gpt.validate();
  parallel::check_gpt_tensor_parallel(args.gpt, args.world);
  std::vector<TorchPeer> peers;
  for (const auto& name : args.torch_peers) {
    TorchPeer peer = find_torch_peer(name, "bench tp");
    if (!peer.available()) continue;
    if (std::atoi(peer.version.c_str()) < 2) {
      log::warn("bench tp: the ", name, " PyTorch is ", peer.version,
                ", not 2.x: no torch.distributed.tensor.parallel; its mode is skipped");
      continue;
    }
    peers.push_back(peer);
  }
  std::vector<Mode> modes{Mode("shoal_ddp"), Mode("single"), Mode("shoal_tp")};
  for (const auto& peer : peers) modes.emplace_back("pytorch_tp", &peer);
  const TempDir dir("tp");
  std::vector<BenchMode*> all;
  for (auto& mode : modes) all.push_back(&mode);
  run_rounds_beside_first(
      all, args.rounds, [&](BenchMode& mode) { run_mode(args, dir, static_cast<Mode&>(mode)); },
      "vs_ddp");
  if (!args.json) {
    const models::GptConfig& g = args.gpt;
    std::printf("bench tp: gpt n_layer %lld n_head %lld n_embd %lld block %lld vocab %lld, global "
                "batch %d blocks, %d steps, SGD momentum, median of %d rounds\n",
                static_cast<long long>(g.n_layer), static_cast<long long>(g.n_head),
                static_cast<long long>(g.n_embd), static_cast<long long>(g.block_size),
                static_cast<long long>(g.vocab_size), args.world * args.batch, args.steps,
                args.rounds);
    std::printf("%-10s %5s %10s %8s %13s %8s %9s %9s\n", "mode", "ranks", "samples/s", "vs_ddp",
                "vs_ddp range", "vs_pt", "held MB", "peak MB");
  }
  for (const auto& mode : modes) print_mode(args, modes, mode);
  if (!args.json) {
    std::printf("vs_ddp = samples/s / the mean of the two shoal_ddp runs beside it, median over "
                "the rounds; vs_pt = shoal_tp's vs_ddp / pytorch_tp's, round by round; held MB = "
                "parameters + gradients + momentum a rank keeps between steps (largest rank)\n");
  }
  return 0;
}

}  // namespace bench_tp

void add_bench_tp_command(CLI::App& bench, std::vector<Command>& commands) {
  auto args = std::make_shared<bench_tp::TpBenchArgs>();
  auto* app = bench.add_subcommand(
      "tp", "Tensor parallelism on the built-in GPT vs one process and Shoal's DDP on the same "
            "global batch: samples/s and memory per rank");
  add_step_options(*app, *args);
  app->get_option("--model")->description("gpt (the model tensor parallelism splits)");
  app->add_option("--batch", args->batch, "Blocks per rank and step under DDP (global batch: "
                                          "--world x --batch)")
      ->capture_default_str();
  app->add_option("--world", args->world, "Ranks of shoal_ddp and shoal_tp (the tp degree)")
      ->capture_default_str();
  add_gpt_size_options(*app, args->gpt);  // as shoal train --model gpt
  app->add_option("--torch-script", args->torch_script, "PyTorch peer script")->capture_default_str();
  add_torch_option(*app, args->torch_peers);
  commands.push_back({app, [args] { return bench_tp::run_tp_bench(*args); }});
}

}  // namespace shoal::cli
