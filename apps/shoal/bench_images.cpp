// `shoal bench images --data-dir DIR`: whether the image pipeline keeps a model's training step
// fed. The CNN (or --model, built for the images' shape) trains on DIR's folders of images as
// `shoal train --data-dir DIR --num-workers N` reads them (the same transforms and flags, the
// loader's N threads decoding ahead of the step), and every step's time is split into the wait
// for its batch and the rest: the fraction spent waiting is what a faster loader could win back
// (the aim: 5 % or less with 2 workers). Reported beside it: the loader's own rate with nothing
// else running (batches/s), to set against the step's consumption.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "bench_harness.h"
#include "bench_util.h"
#include "commands.h"
#include "compat/thread_parallelism.h"
#include "shoal/data/data_loader.h"
#include "shoal/data/image_folder.h"
#include "shoal/error.h"
#include "shoal/models/registry.h"

namespace shoal::cli {
namespace {

struct ImageBenchArgs {
  std::string data_dir;
  std::string model = "cnn";
  data::ImageFolderOptions images;
  int workers = 2;
  int64_t batch_size = 64;
  int steps = 30;
  int warmup = 3;
  int threads = 1;
  bool json = false;
};

// Batches of `dataset` without end: a new shuffled epoch whenever one runs out, as training reads.
class EndlessLoader {
 public:
  EndlessLoader(const data::ImageFolder& dataset, const ImageBenchArgs& args)
      : dataset_(dataset), args_(args) {}
  data::Batch next() {
    for (;;) {
      if (loader_) {
        if (std::optional<data::Batch> batch = loader_->next()) return std::move(*batch);
      }
      dataset_.set_epoch(epoch_);
      data::DataLoaderOptions options;
      options.batch_size = args_.batch_size;
      options.num_workers = args_.workers;
      options.drop_last = true;
      loader_.reset();  // its workers stop before the next epoch's start
      loader_ = std::make_unique<data::DataLoader>(dataset_, torch::randperm(dataset_.size()), options);
      ++epoch_;
    }
  }

 private:
  const data::ImageFolder& dataset_;
  const ImageBenchArgs& args_;
  std::unique_ptr<data::DataLoader> loader_;
  int64_t epoch_ = 0;
};

// Seconds waiting for batches and in all, over `steps` steps.
struct FeedTimes {
  double wait = 0;
  double total = 0;
};

FeedTimes train_steps(EndlessLoader& loader, models::Model& model,
                      torch::optim::Optimizer& optimizer, int steps) {
  FeedTimes times;
  for (int i = 0; i < steps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    const data::Batch batch = loader.next();
    times.wait += seconds_since(start);
    optimizer.zero_grad();
    torch::cross_entropy_loss(model.forward(batch.data), batch.target).backward();
    optimizer.step();
    times.total += seconds_since(start);
  }
  return times;
}

// The loader alone: batches/s over `batches` batches, nothing else running.
double loader_rate(const data::ImageFolder& dataset, const ImageBenchArgs& args, int batches) {
  EndlessLoader loader(dataset, args);
  loader.next();  // the workers started
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < batches; ++i) loader.next();
  return batches / seconds_since(start);
}

int bench_images(const ImageBenchArgs& args) {
  SHOAL_CHECK_T(InvalidArgument, args.steps > 0 && args.warmup >= 0 && args.batch_size > 0,
                "bench images: --steps and --batch-size must be positive");
  check_bench_model("bench images", args.model);
  compat::set_compute_threads(args.threads);  // LibTorch's and OpenBLAS's pools
  const data::ImageFolderSplits splits = data::open_image_folders(args.data_dir, args.images);
  const data::ImageFolder& dataset = *splits.train;
  SHOAL_CHECK_T(InvalidArgument, dataset.size() >= args.batch_size, "bench images: ",
                args.data_dir, " has ", dataset.size(), " training images, fewer than --batch-size ",
                args.batch_size);
  const at::Tensor first = dataset.get(0).data;
  models::InputShape shape{first.size(0), first.size(1), first.size(2),
                           static_cast<int64_t>(dataset.classes().size())};
  auto model = models::create(args.model, 0, shape);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  EndlessLoader loader(dataset, args);
  train_steps(loader, *model, optimizer, args.warmup);
  const FeedTimes times = train_steps(loader, *model, optimizer, args.steps);
  const double step_ms = 1e3 * times.total / args.steps;
  const double wait_ms = 1e3 * times.wait / args.steps;
  const double load_rate = loader_rate(dataset, args, args.steps);
  ReportLine line;
  line.add("bench", "images").add("data_dir", args.data_dir).add("model", args.model)
      .add("workers", args.workers).add("batch_size", args.batch_size).add("steps", args.steps)
      .add("step_ms", step_ms).add("wait_ms", wait_ms).add("wait_fraction", times.wait / times.total)
      .add("samples_per_s", args.batch_size * args.steps / times.total)
      .add("loader_batches_per_s", load_rate)
      .add("loader_over_step", load_rate * times.total / args.steps);
  if (args.json) {
    line.print();
    return 0;
  }
  std::printf("bench images: %s, %s on %lldx%lldx%lld images, batch %lld, %d loader workers, "
              "%d threads\n  step %.2f ms, of which waiting for data %.2f ms (%.1f %%); %.1f "
              "samples/s\n  the loader alone: %.1f batches/s, %.2fx what the step consumes\n",
              args.data_dir.c_str(), args.model.c_str(), static_cast<long long>(shape.channels),
              static_cast<long long>(shape.height), static_cast<long long>(shape.width),
              static_cast<long long>(args.batch_size), args.workers, args.threads, step_ms, wait_ms,
              100 * times.wait / times.total, args.batch_size * args.steps / times.total, load_rate,
              load_rate * times.total / args.steps);
  return 0;
}

}  // namespace

void add_bench_images_command(CLI::App& bench, std::vector<Command>& commands) {
  auto args = std::make_shared<ImageBenchArgs>();
  auto* app = bench.add_subcommand(
      "images", "Whether the image pipeline keeps the CNN's step fed: the share of each step spent "
                "waiting for data, with --num-workers loader threads");
  app->add_option("--data-dir", args->data_dir,
                  "a folder of images (class folders; or DIR/train beside DIR/val)")
      ->required();
  app->add_option("--model", args->model, "a built-in image model: cnn, mlp or transformer")
      ->capture_default_str();
  add_image_folder_options(*app, args->images);
  app->add_option("--num-workers,--num_workers", args->workers,
                  "threads loading batches ahead of the step")
      ->check(CLI::Range(0, 256))
      ->capture_default_str();
  app->add_option("--batch-size", args->batch_size, "images per step")->capture_default_str();
  app->add_option("--steps", args->steps, "timed steps")->capture_default_str();
  app->add_option("--warmup", args->warmup, "untimed steps first")->capture_default_str();
  app->add_option("--threads", args->threads, "intra-op threads of the step")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app->add_flag("--json", args->json, "one JSON object");
  commands.push_back({app, [args] { return bench_images(*args); }});
}

}  // namespace shoal::cli
