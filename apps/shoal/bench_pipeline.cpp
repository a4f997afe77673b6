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
//
// --model gpt: the built-in GPT (its sizes given as to `shoal train --model gpt`) on random token
// blocks, cut between its blocks (embeddings, blocks, head) as `shoal train --strategy pipeline`
// cuts it, trained with its own loss; the tied embedding and head, held by the first and the last
// stage, have their gradients summed after each backward (pipeline::TiedParameters), as the
// trainer does. A sample is a block of --block-size tokens.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "bench_harness.h"
#include "bench_util.h"
#include "commands.h"
#include "compat/thread_parallelism.h"
#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "shoal/memory/cpu_allocator.h"
#include "shoal/models/registry.h"
#include "shoal/parallel/distributed_data_parallel.h"
#include "shoal/pipeline/pipeline.h"
#include "shoal/pipeline/pipeline_grid.h"
#include "shoal/pipeline/pipeline_partition.h"
#include "shoal/pipeline/pipeline_sequential.h"
#include "shoal/pipeline/tied_parameters.h"

namespace shoal::cli {
namespace {

using Clock = std::chrono::steady_clock;

// A run that takes longer than this is hung: its processes are killed.
constexpr std::chrono::seconds kRunDeadline{300};

struct PipelineBenchArgs : StepBenchArgs {
  PipelineBenchArgs() { model = "mlp"; }  // bench pipeline's default
  int stages = 2;
  std::vector<int64_t> micro_batches{1, 4, 8};
  int batch = 64;             // --model gpt where not given: see choose_batch()
  models::GptConfig gpt;      // --model gpt's sizes
};

// --model gpt without --batch: 16 blocks (8 per DDP rank at 2 stages, as bench ddp's default; a
// step of the default GPT about as long as the MLP's batch of 64 images takes on the CNN).
void choose_batch(PipelineBenchArgs& args, bool batch_given) {
  if (args.model == "gpt" && !batch_given) args.batch = 16;
}

// The model and one global batch of its samples: images for the classifiers, random token blocks
// (inputs and targets) for the GPT.
struct Workload {
  std::shared_ptr<models::Model> model;
  at::Tensor x, y;
  // The batch's loss from the model's output (its logits): the GPT's own (cross-entropy over
  // every position), else cross-entropy.
  models::SequentialLoss loss;
};

Workload make_workload(const PipelineBenchArgs& args) {
  Workload work;
  if (args.model == "gpt") {
    models::ModelOptions options;
    options.gpt = args.gpt;
    work.model = models::create(args.model, 0, options);
    work.x = torch::randint(0, args.gpt.vocab_size, {args.batch, args.gpt.block_size}, torch::kLong);
    work.y = torch::randint(0, args.gpt.vocab_size, {args.batch, args.gpt.block_size}, torch::kLong);
    work.loss = work.model->sequential_loss();
  } else {
    work.model = models::create(args.model, 0);
    work.x = torch::randn({args.batch, 1, 28, 28});
    work.y = torch::randint(0, 10, {args.batch}, torch::kLong);
  }
  if (!work.loss.loss) {
    work.loss.loss = [](const at::Tensor& output, const at::Tensor& target) {
      return torch::nn::functional::cross_entropy(output, target);
    };
  }
  return work;
}

struct RunSpec {
  std::string mode;  // "pipeline", "ddp", "single"
  pipeline::Schedule schedule = pipeline::Schedule::k1F1B;
  int64_t micro_batches = 1;
  std::string label() const {
    if (mode != "pipeline") return mode;
    return std::string(pipeline::to_string(schedule)) + " M=" + std::to_string(micro_batches);
  }
};

// Seconds that args.steps calls of step() take after args.warmup untimed ones; with a group, from
// a barrier to a barrier (the slowest rank's time); `before_timing` runs right before the clock.
double time_steps(const PipelineBenchArgs& args, const std::function<void()>& step,
                  comm::ProcessGroup* group, const std::function<void()>& before_timing = {}) {
  for (int i = 0; i < args.warmup; ++i) step();
  if (group) group->barrier()->wait();
  if (before_timing) before_timing();
  const auto start = Clock::now();
  for (int i = 0; i < args.steps; ++i) step();
  if (group) group->barrier()->wait();
  return seconds_since(start);
}

// The pipeline's stage `rank` of `spec` on `group`: its time and its stage's figures.
Values time_pipeline_stage(const PipelineBenchArgs& args, const RunSpec& spec, int rank,
                           std::shared_ptr<comm::ProcessGroup> group, const Workload& work) {
  const int world = group->size();
  torch::nn::Sequential seq = pipeline::as_sequential(*work.model);
  const auto balance = pipeline::balance_by_parameters(seq, world);
  pipeline::PipelineOptions options;
  options.micro_batches = spec.micro_batches;
  options.schedule = spec.schedule;
  const pipeline::PipelineGrid grid(group, world);
  pipeline::Pipeline pipe(pipeline::stage_module(seq, balance, rank), group, grid.stage_ranks(),
                          options);
  pipeline::TiedParameters tied(seq, balance, grid);
  torch::optim::SGD sgd(work.model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto step = [&] {
    sgd.zero_grad();
    pipe.forward_backward(work.x, work.y, work.loss.loss, work.loss.terms);
    tied.all_reduce_gradients();
    sgd.step();
  };
  Values values;
  values["seconds"] = time_steps(args, step, group.get(), [&] { pipe.reset_stats(); });
  const pipeline::PipelineStats stats = pipe.stats();
  values["idle_fraction"] = stats.idle_fraction();
  values["peak_activation_mb"] = stats.peak_activation_bytes / 1048576.0;
  values["peak_in_flight"] = static_cast<double>(stats.peak_in_flight);
  values["layers"] = static_cast<double>(pipe.module()->size());
  return values;
}

// One rank of one run, in a forked child; writes its numbers to `result`.
void run_rank(const PipelineBenchArgs& args, const RunSpec& spec, int rank, int world,
              const std::string& store_path, const std::string& result) {
  memory::tune_cpu_allocator();
  compat::set_compute_threads(1);  // LibTorch's and OpenBLAS's pools: idle BLAS threads spin
  torch::manual_seed(0);  // every rank draws the same weights and batch
  const Workload work = make_workload(args);
  const auto& model = work.model;
  Values values;
  if (spec.mode == "single") {
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    auto step = [&] {
      sgd.zero_grad();
      work.loss.loss(model->forward(work.x), work.y).backward();
      sgd.step();
    };
    values["seconds"] = time_steps(args, step, nullptr);
  } else if (spec.mode == "ddp") {
    auto group = comm::new_process_group("shm", comm::make_file_store(store_path, world), rank, world);
    const int64_t share = args.batch / world;
    auto xr = work.x.narrow(0, rank * share, share);
    auto yr = work.y.narrow(0, rank * share, share);
    DistributedDataParallel<models::Model> ddp(model, group);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    auto step = [&] {
      sgd.zero_grad();
      work.loss.loss(ddp.forward(xr), yr).backward();
      sgd.step();
    };
    values["seconds"] = time_steps(args, step, group.get());
  } else {
    auto group = comm::new_process_group("shm", comm::make_file_store(store_path, world), rank, world);
    values = time_pipeline_stage(args, spec, rank, group, work);
  }
  write_values(result, values, "bench pipeline");
}

// Forks `world` ranks of `spec`; returns each rank's numbers (empty when the run failed).
std::vector<Values> run(const PipelineBenchArgs& args, const RunSpec& spec, int world,
                        const TempDir& dir) {
  static int counter = 0;
  const std::string stem = dir.file("run" + std::to_string(counter++));
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

// One run's samples: by rank, field -> one value per round.
using RankSamples = std::vector<std::map<std::string, std::vector<double>>>;

// Every spec's runs, the specs in order each round; samples[spec][rank][field].
std::vector<RankSamples> run_pipeline_rounds(const PipelineBenchArgs& args,
                                             const std::vector<RunSpec>& specs) {
  const TempDir dir("pipeline");
  std::vector<RankSamples> samples(specs.size());
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
  return samples;
}

// The median of a rank's field; NaN when it has none.
double rank_median(const RankSamples& ranks, size_t rank, const std::string& key) {
  const auto& fields = ranks[rank];
  auto it = fields.find(key);
  return it == fields.end() ? std::nan("") : median(it->second);
}

// samples/s of a run: the global batch's steps over the slowest rank's time.
double pipeline_rate(const PipelineBenchArgs& args, const RankSamples& ranks) {
  double seconds = 0;
  for (size_t r = 0; r < ranks.size(); ++r) seconds = std::max(seconds, rank_median(ranks, r, "seconds"));
  return args.batch * args.steps / seconds;
}

// One pipeline run's line per stage.
void print_pipeline_stages(const PipelineBenchArgs& args, const RunSpec& spec,
                           const RankSamples& ranks, double ddp_rate) {
  const double theory = pipeline::theoretical_bubble_fraction(args.stages, spec.micro_batches);
  const double r = pipeline_rate(args, ranks);
  for (size_t s = 0; s < ranks.size(); ++s) {
    const double idle = rank_median(ranks, s, "idle_fraction");
    const double mb = rank_median(ranks, s, "peak_activation_mb");
    const double in_flight = rank_median(ranks, s, "peak_in_flight");
    if (args.json) {
      ReportLine()
          .add("mode", "pipeline").add("model", args.model)
          .add("schedule", pipeline::to_string(spec.schedule))
          .add("stages", args.stages).add("micro_batches", spec.micro_batches)
          .add("stage", static_cast<int64_t>(s)).add("samples_per_s", r).add("vs_ddp", r / ddp_rate)
          .add("idle_fraction", idle).add("theoretical_bubble", theory)
          .add("peak_in_flight", in_flight).add("peak_activation_mb", mb)
          .print();
    } else {
      std::printf("  %-12s %6zu %10.1f %8.2f %8.3f %10.3f %9.0f %14.2f\n", spec.label().c_str(), s,
                  r, r / ddp_rate, idle, theory, in_flight, mb);
    }
  }
}

// " (4 layers, 4 heads, 128 wide, blocks of 128 tokens, vocabulary 256)" for --model gpt.
std::string gpt_sizes(const PipelineBenchArgs& args) {
  if (args.model != "gpt") return "";
  const models::GptConfig& g = args.gpt;
  return " (" + std::to_string(g.n_layer) + " layers, " + std::to_string(g.n_head) + " heads, " +
         std::to_string(g.n_embd) + " wide, blocks of " + std::to_string(g.block_size) +
         " tokens, vocabulary " + std::to_string(g.vocab_size) + ")";
}

int run_pipeline_bench(const PipelineBenchArgs& args) {
  check_bench_model("bench pipeline", args.model, {"gpt"});
  if (args.model == "gpt") args.gpt.validate();
  SHOAL_CHECK_T(InvalidArgument, args.stages >= 2, "bench pipeline: --stages must be at least 2");
  for (int64_t m : args.micro_batches) {
    SHOAL_CHECK_T(InvalidArgument, m >= 1 && m <= args.batch, "bench pipeline: ", m,
                  " micro-batches do not fit a batch of ", args.batch);
  }
  std::vector<RunSpec> specs{{"single"}, {"ddp"}};
  for (int64_t m : args.micro_batches) {
    for (auto schedule : {pipeline::Schedule::kGPipe, pipeline::Schedule::k1F1B}) {
      specs.push_back({"pipeline", schedule, m});
    }
  }
  const std::vector<RankSamples> samples = run_pipeline_rounds(args, specs);
  const double single_rate = pipeline_rate(args, samples[0]);
  const double ddp_rate = pipeline_rate(args, samples[1]);
  if (!args.json) {
    std::printf("shoal bench pipeline: model %s%s, %d stages (shm), global batch %d, %d steps, "
                "median of %d rounds, 1 thread per process\n",
                args.model.c_str(), gpt_sizes(args).c_str(), args.stages, args.batch, args.steps,
                args.rounds);
    std::printf("  single process: %.1f samples/s;  DDP on %d processes: %.1f samples/s\n",
                single_rate, args.stages, ddp_rate);
    std::printf("  %-12s %6s %10s %8s %8s %10s %9s %14s\n", "schedule", "stage", "samples/s",
                "vs DDP", "idle", "theory", "in-flight", "activations MB");
  } else {
    ReportLine().add("mode", "single").add("model", args.model).add("samples_per_s", single_rate)
        .print();
    ReportLine().add("mode", "ddp").add("model", args.model).add("world", args.stages)
        .add("samples_per_s", ddp_rate).print();
  }
  for (size_t i = 2; i < specs.size(); ++i) print_pipeline_stages(args, specs[i], samples[i], ddp_rate);
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
  app->get_option("--model")->description("a built-in model: cnn, mlp, transformer or gpt");
  app->add_option("--stages", args->stages, "pipeline stages K (= DDP ranks)")
      ->capture_default_str();
  app->add_option("--micro-batches", args->micro_batches, "micro-batch counts M to measure")
      ->delimiter(',')
      ->capture_default_str();
  auto* batch = app->add_option("--batch", args->batch,
                                "global batch per step (--model gpt: 16 blocks unless given)")
                     ->capture_default_str();
  add_gpt_size_options(*app, args->gpt);  // as shoal train --model gpt
  commands.push_back({app, [args, batch] {
                        choose_batch(*args, batch->count() > 0);
                        return run_pipeline_bench(*args);
                      }});
}

}  // namespace shoal::cli
