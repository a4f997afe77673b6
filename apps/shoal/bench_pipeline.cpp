// `shoal bench pipeline`: pipeline parallelism measured side by side with DDP on the same model,
// global batch and thread count.
//
// For each schedule (GPipe, 1F1B) and each micro-batch count M, K fresh processes (one per stage,
// one intra-op thread each, over the shm backend) train the model for some steps; each stage
// reports its measured idle fraction (1 - time running its layers / step time) next to the ideal
// pipeline's bubble (K-1)/(M+K-1), the most bytes of activations it held for backward (layer
// outputs kept by autograd, counted per micro-batch: 1F1B holds at most K - s micro-batches on
// stage s, GPipe all M), and the samples per second. Then K processes of DDP (each rank 1/K of
// the batch) and one process alone train the same model on the same global batch. Processes are
// forked from this one; every run's numbers are the median over --rounds rounds, the modes
// interleaved so that the machine's noise spreads over all of them.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "bench_util.h"
#include "commands.h"
#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "shoal/memory/cpu_allocator.h"
#include "shoal/models/registry.h"
#include "shoal/parallel/distributed_data_parallel.h"
#include "shoal/pipeline/pipeline.h"
#include "shoal/pipeline/pipeline_partition.h"
#include "shoal/pipeline/pipeline_sequential.h"

namespace shoal::cli {
namespace {

using Clock = std::chrono::steady_clock;

// A run that takes longer than this is hung: its processes are killed.
constexpr std::chrono::seconds kRunDeadline{300};

struct PipelineBenchArgs : StepBenchArgs {
  PipelineBenchArgs() { model = "mlp"; }  // bench pipeline's default
  int stages = 2;
  std::vector<int64_t> micro_batches{1, 4, 8};
  int batch = 64;
};

struct RunSpec {
  std::string mode;  // "pipeline", "ddp", "single"
  pipeline::Schedule schedule = pipeline::Schedule::k1F1B;
  int64_t micro_batches = 1;
  std::string label() const {
    if (mode != "pipeline") return mode;
    return std::string(pipeline::to_string(schedule)) + " M=" + std::to_string(micro_batches);
  }
};

// One rank of one run, in a forked child; writes its numbers to `result`.
void run_rank(const PipelineBenchArgs& args, const RunSpec& spec, int rank, int world,
              const std::string& store_path, const std::string& result) {
  memory::tune_cpu_allocator();
  torch::set_num_threads(1);
  std::shared_ptr<models::Model> model = models::create(args.model, 0);
  auto x = torch::randn({args.batch, 1, 28, 28});
  auto y = torch::randint(0, 10, {args.batch}, torch::kLong);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  Values values;
  if (spec.mode == "single") {
    auto step = [&] {
      sgd.zero_grad();
      torch::cross_entropy_loss(model->forward(x), y).backward();
      sgd.step();
    };
    for (int i = 0; i < args.warmup; ++i) step();
    const auto start = Clock::now();
    for (int i = 0; i < args.steps; ++i) step();
    values["seconds"] = seconds_since(start);
    write_values(result, values, "bench pipeline");
    return;
  }
  auto store = comm::make_file_store(store_path, world);
  auto group = comm::new_process_group("shm", store, rank, world);
  if (spec.mode == "ddp") {
    const int64_t share = args.batch / world;
    auto xr = x.narrow(0, rank * share, share);
    auto yr = y.narrow(0, rank * share, share);
    DistributedDataParallel<models::Model> ddp(model, group);
    auto step = [&] {
      sgd.zero_grad();
      torch::cross_entropy_loss(ddp.forward(xr), yr).backward();
      sgd.step();
    };
    for (int i = 0; i < args.warmup; ++i) step();
    group->barrier()->wait();
    const auto start = Clock::now();
    for (int i = 0; i < args.steps; ++i) step();
    group->barrier()->wait();
    values["seconds"] = seconds_since(start);
    write_values(result, values, "bench pipeline");
    return;
  }
  torch::nn::Sequential seq = pipeline::as_sequential(*model);
  const auto balance = pipeline::balance_by_parameters(seq, world);
  pipeline::PipelineOptions options;
  options.micro_batches = spec.micro_batches;
  options.schedule = spec.schedule;
  std::vector<int> ranks;
  for (int r = 0; r < world; ++r) ranks.push_back(r);
  pipeline::Pipeline pipe(pipeline::stage_module(seq, balance, rank), group, ranks, options);
  auto loss = [](const at::Tensor& output, const at::Tensor& target) {
    return torch::nn::functional::cross_entropy(output, target);
  };
  auto step = [&] {
    sgd.zero_grad();
    pipe.forward_backward(x, y, loss);
    sgd.step();
  };
  for (int i = 0; i < args.warmup; ++i) step();
  group->barrier()->wait();
  pipe.reset_stats();
  const auto start = Clock::now();
  for (int i = 0; i < args.steps; ++i) step();
  group->barrier()->wait();
  values["seconds"] = seconds_since(start);
  const pipeline::PipelineStats stats = pipe.stats();
  values["idle_fraction"] = stats.idle_fraction();
  values["peak_activation_mb"] = stats.peak_activation_bytes / 1048576.0;
  values["peak_in_flight"] = static_cast<double>(stats.peak_in_flight);
  values["layers"] = static_cast<double>(pipe.module()->size());
  write_values(result, values, "bench pipeline");
}

// Forks `world` ranks of `spec`; returns each rank's numbers (empty when the run failed).
std::vector<Values> run(const PipelineBenchArgs& args, const RunSpec& spec, int world,
                        const std::string& dir) {
  static int counter = 0;
  const std::string stem = dir + "/run" + std::to_string(counter++);
  std::vector<ChildProcess> ranks;
  for (int rank = 0; rank < world; ++rank) {
    ChildProcess child;
    child.function = [&, rank] {
      run_rank(args, spec, rank, world, stem + ".store", stem + ".rank" + std::to_string(rank));
      return 0;
    };
    child.label = spec.label() + " rank " + std::to_string(rank);
    ranks.push_back(child);
  }
  RunProcessesOptions options;
  options.benchmark = "bench pipeline";
  options.run = "the " + spec.label() + " run";
  options.deadline = kRunDeadline;
  std::vector<Values> out;
  if (run_processes(ranks, options) != 0) return out;
  for (int rank = 0; rank < world; ++rank) {
    out.push_back(read_values(stem + ".rank" + std::to_string(rank)));
  }
  return out;
}

int run_pipeline_bench(const PipelineBenchArgs& args) {
  SHOAL_CHECK_T(InvalidArgument, args.stages >= 2, "bench pipeline: --stages must be at least 2");
  for (int64_t m : args.micro_batches) {
    SHOAL_CHECK_T(InvalidArgument, m >= 1 && m <= args.batch, "bench pipeline: ", m,
                  " micro-batches do not fit a batch of ", args.batch);
  }
  char pattern[] = "/tmp/shoal_bench_pipeline_XXXXXX";
  SHOAL_CHECK(mkdtemp(pattern) != nullptr, "bench pipeline: cannot create a temporary folder");
  const std::string dir = pattern;

  std::vector<RunSpec> specs{{"single"}, {"ddp"}};
  for (int64_t m : args.micro_batches) {
    for (auto schedule : {pipeline::Schedule::kGPipe, pipeline::Schedule::k1F1B}) {
      specs.push_back({"pipeline", schedule, m});
    }
  }
  // samples[spec][rank][field] -> one value per round.
  std::vector<std::vector<std::map<std::string, std::vector<double>>>> samples(specs.size());
  for (int round = 0; round < args.rounds; ++round) {
    for (size_t i = 0; i < specs.size(); ++i) {
      const int world = specs[i].mode == "single" ? 1 : args.stages;
      const std::vector<Values> ranks = run(args, specs[i], world, dir);
      SHOAL_CHECK(!ranks.empty(), "bench pipeline: the ", specs[i].label(), " run failed");
      samples[i].resize(ranks.size());
      for (size_t r = 0; r < ranks.size(); ++r) {
        for (const auto& [key, value] : ranks[r]) samples[i][r][key].push_back(value);
      }
    }
  }
  std::filesystem::remove_all(dir);

  const auto get = [&](size_t spec, size_t rank, const std::string& key) {
    const auto& fields = samples[spec][rank];
    auto it = fields.find(key);
    return it == fields.end() ? std::nan("") : median(it->second);
  };
  const auto rate = [&](size_t spec) {
    double seconds = 0;
    for (size_t r = 0; r < samples[spec].size(); ++r) seconds = std::max(seconds, get(spec, r, "seconds"));
    return args.batch * args.steps / seconds;
  };
  const double single_rate = rate(0);
  const double ddp_rate = rate(1);
  if (!args.json) {
    std::printf("shoal bench pipeline: model %s, %d stages (shm), global batch %d, %d steps, "
                "median of %d rounds, 1 thread per process\n",
                args.model.c_str(), args.stages, args.batch, args.steps, args.rounds);
    std::printf("  single process: %.1f samples/s;  DDP on %d processes: %.1f samples/s\n",
                single_rate, args.stages, ddp_rate);
    std::printf("  %-12s %6s %10s %8s %8s %10s %9s %14s\n", "schedule", "stage", "samples/s",
                "vs DDP", "idle", "theory", "in-flight", "activations MB");
  } else {
    std::printf("{\"mode\": \"single\", \"samples_per_s\": %s}\n", json_number(single_rate).c_str());
    std::printf("{\"mode\": \"ddp\", \"world\": %d, \"samples_per_s\": %s}\n", args.stages,
                json_number(ddp_rate).c_str());
  }
  for (size_t i = 2; i < specs.size(); ++i) {
    const double theory = pipeline::theoretical_bubble_fraction(args.stages, specs[i].micro_batches);
    const double r = rate(i);
    for (size_t s = 0; s < samples[i].size(); ++s) {
      const double idle = get(i, s, "idle_fraction");
      const double mb = get(i, s, "peak_activation_mb");
      const double in_flight = get(i, s, "peak_in_flight");
      if (args.json) {
        std::printf("{\"mode\": \"pipeline\", \"schedule\": \"%s\", \"stages\": %d, "
                    "\"micro_batches\": %lld, \"stage\": %zu, \"samples_per_s\": %s, "
                    "\"vs_ddp\": %s, \"idle_fraction\": %s, \"theoretical_bubble\": %s, "
                    "\"peak_in_flight\": %s, \"peak_activation_mb\": %s}\n",
                    pipeline::to_string(specs[i].schedule), args.stages,
                    static_cast<long long>(specs[i].micro_batches), s, json_number(r).c_str(),
                    json_number(r / ddp_rate).c_str(), json_number(idle).c_str(),
                    json_number(theory).c_str(), json_number(in_flight).c_str(),
                    json_number(mb).c_str());
      } else {
        std::printf("  %-12s %6zu %10.1f %8.2f %8.3f %10.3f %9.0f %14.2f\n",
                    specs[i].label().c_str(), s, r, r / ddp_rate, idle, theory, in_flight, mb);
      }
    }
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

void add_bench_pipeline_command(CLI::App& bench, std::vector<Command>& commands) {
  auto args = std::make_shared<PipelineBenchArgs>();
  auto* app = bench.add_subcommand(
      "pipeline",
      "Pipeline parallelism (GPipe, 1F1B) vs DDP: per-stage idle fraction vs (K-1)/(M+K-1),\n"
      "peak activation memory per stage, samples/s");
  add_step_options(*app, *args);
  app->add_option("--stages", args->stages, "pipeline stages K (= DDP ranks)")
      ->capture_default_str();
  app->add_option("--micro-batches", args->micro_batches, "micro-batch counts M to measure")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--batch", args->batch, "global batch per step")->capture_default_str();
  commands.push_back({app, [args] { return run_pipeline_bench(*args); }});
}

}  // namespace shoal::cli
