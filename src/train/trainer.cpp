#include "shoal/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "shoal/checkpoint/checkpoint_manager.h"
#include "shoal/checkpoint/serialization.h"
#include "shoal/checkpoint/training_state.h"
#include "shoal/data/fashion_mnist.h"
#include "shoal/error.h"
#include "shoal/memory/cpu_allocator.h"
#include "shoal/models/registry.h"
#include "shoal/train/metrics_writer.h"
#include "shoal/train/progress.h"

namespace shoal::train {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void check_data(const TensorData& data, const char* what) {
  SHOAL_CHECK_T(InvalidArgument, data.inputs.defined() && data.targets.defined(), "the ", what,
                " set has no tensors");
  SHOAL_CHECK_T(InvalidArgument, data.inputs.size(0) == data.targets.size(0), "the ", what,
                " set has ", data.inputs.size(0), " inputs but ", data.targets.size(0),
                " targets");
}

}  // namespace

double train_step(TrainState& state, const at::Tensor& inputs, const at::Tensor& targets) {
  state.optimizer->zero_grad();
  const at::Tensor logits = state.forward(inputs);
  const at::Tensor loss = torch::nn::functional::cross_entropy(logits, targets);
  loss.backward();
  state.optimizer->step();
  ++state.step;
  return loss.item<double>();
}

EvalResult evaluate(torch::nn::Module& model,
                    const std::function<at::Tensor(const at::Tensor&)>& forward,
                    const TensorData& data, int64_t batch_size) {
  SHOAL_CHECK_T(InvalidArgument, batch_size >= 1, "evaluate: batch size must be at least 1");
  const bool was_training = model.is_training();
  model.eval();
  torch::NoGradGuard no_grad;
  double loss_sum = 0;
  int64_t correct = 0;
  const int64_t n = data.size();
  for (int64_t begin = 0; begin < n; begin += batch_size) {
    const int64_t end = std::min(n, begin + batch_size);
    const at::Tensor logits = forward(data.inputs.slice(0, begin, end));
    const at::Tensor targets = data.targets.slice(0, begin, end);
    loss_sum += torch::nn::functional::cross_entropy(
                    logits, targets,
                    torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                    .item<double>();
    correct += logits.argmax(1).eq(targets).sum().item<int64_t>();
  }
  model.train(was_training);
  EvalResult result;
  result.samples = n;
  if (n > 0) {
    result.loss = loss_sum / static_cast<double>(n);
    result.accuracy = static_cast<double>(correct) / static_cast<double>(n);
  }
  return result;
}

Trainer::Trainer(TrainOptions options, std::shared_ptr<models::Model> model,
                 std::unique_ptr<Strategy> strategy)
    : options_(std::move(options)), strategy_(std::move(strategy)) {
  options_.validate();
  SHOAL_CHECK_T(InvalidArgument, model != nullptr, "Trainer: no model given");
  memory::tune_cpu_allocator();  // steps reuse freed memory instead of faulting it in again
  if (!strategy_) strategy_ = std::make_unique<SingleProcess>();
  state_.model = std::move(model);
  state_.optimizer = std::make_unique<torch::optim::SGD>(
      state_.model->parameters(),
      torch::optim::SGDOptions(options_.lr).momentum(options_.momentum));
}

Trainer::~Trainer() = default;

checkpoint::TrainingState load_resume_checkpoint(const TrainOptions& options, std::string* path) {
  SHOAL_CHECK_T(InvalidArgument, !options.checkpoint_dir.empty(),
                "--resume needs --checkpoint-dir DIR: the folder to resume from");
  const std::optional<std::string> latest = checkpoint::find_latest(options.checkpoint_dir);
  SHOAL_CHECK_T(CheckpointError, latest.has_value(), "--resume: no checkpoint in ",
                options.checkpoint_dir, "; run without --resume to start from scratch");
  checkpoint::TrainingState saved = checkpoint::load_training_state(*latest);
  const auto model = saved.config.find("model");
  const std::string saved_model = model == saved.config.end() ? "unknown" : model->second;
  SHOAL_CHECK_T(CheckpointError, saved_model == options.model, "--resume: ", *latest,
                " is a checkpoint of model '", saved_model, "', not '", options.model,
                "'; pass --model ", saved_model, " or another --checkpoint-dir");
  if (path != nullptr) *path = *latest;
  return saved;
}

std::string Trainer::resume() {
  std::string path;
  const checkpoint::TrainingState saved = load_resume_checkpoint(options_, &path);
  checkpoint::restore(saved, *state_.model, state_.optimizer.get());
  state_.epoch = saved.epoch;
  state_.step = saved.step;
  // A checkpoint saved at the end of an epoch has samples_seen 0 for the next one.
  resume_samples_seen_ = saved.sampler.epoch == saved.epoch ? saved.sampler.samples_seen : 0;
  return path;
}

void Trainer::save_checkpoint(int64_t completed_epochs, int64_t samples_seen) {
  strategy_->synchronize(state_);
  checkpoint::CheckpointManagerOptions manager_options;
  manager_options.keep_last = options_.checkpoint_keep;
  checkpoint::CheckpointManager manager(options_.checkpoint_dir, manager_options);
  checkpoint::TrainingState state = checkpoint::capture(*state_.model, state_.optimizer.get());
  state.epoch = completed_epochs;
  state.step = state_.step;
  state.sampler.epoch = completed_epochs;
  state.sampler.samples_seen = samples_seen;
  state.sampler.seed = static_cast<int64_t>(options_.seed);
  state.world_size = strategy_->world_size();
  state.config = {{"model", options_.model},
                  {"lr", std::to_string(options_.lr)},
                  {"momentum", std::to_string(options_.momentum)},
                  {"batch_size", std::to_string(options_.batch_size)},
                  {"seed", std::to_string(options_.seed)},
                  {"epochs", std::to_string(options_.epochs)},
                  {"world_size", std::to_string(strategy_->world_size())}};
  manager.save(state, strategy_->process_group());
}

TrainResult Trainer::fit(const TensorData& train, const TensorData& test) {
  check_data(train, "training");
  if (test.size() > 0) check_data(test, "test");
  const int64_t n =
      options_.train_limit > 0 ? std::min(options_.train_limit, train.size()) : train.size();
  SHOAL_CHECK_T(InvalidArgument, n > 0, "the training set is empty");
  const int64_t test_n =
      options_.test_limit > 0 ? std::min(options_.test_limit, test.size()) : test.size();
  if (!prepared_) {
    strategy_->prepare(state_);
    prepared_ = true;
  }
  const bool reports = strategy_->rank() == 0;
  const bool checkpoints = !options_.checkpoint_dir.empty();
  MetricsWriter metrics(reports ? options_.metrics_path : std::string());
  const int64_t batch = options_.batch_size;
  const int64_t world = strategy_->world_size();
  const int64_t rank = strategy_->rank();
  // Processes that train on distinct samples (pipeline stages share theirs).
  const int64_t replicas = world / strategy_->ranks_per_replica();
  const int64_t remaining_epochs = options_.epochs - state_.epoch;
  Progress progress(reports ? options_.progress : ProgressMode::kNone, options_.epochs,
                    std::max<int64_t>(remaining_epochs, 0) * n, options_.log_interval,
                    reports ? stderr : nullptr, reports ? stdout : nullptr);
  // Evaluation is sharded: every rank evaluates a contiguous share of the test set through the
  // unwrapped model (no DDP collectives) and the sums are allreduced, so that W ranks evaluate
  // W times faster than rank 0 alone while the others would wait.
  const int64_t test_begin = test_n * rank / world;
  const int64_t test_end = test_n * (rank + 1) / world;
  const TensorData test_shard{test.size() > 0 ? test.inputs.slice(0, test_begin, test_end)
                                              : at::Tensor(),
                              test.size() > 0 ? test.targets.slice(0, test_begin, test_end)
                                              : at::Tensor()};
  std::shared_ptr<models::Model> model = state_.model;
  const auto plain_forward = [model](const at::Tensor& input) { return model->forward(input); };

  TrainResult result;
  for (; state_.epoch < options_.epochs; ++state_.epoch) {
    const int64_t epoch = state_.epoch;
    const at::Tensor indices = strategy_->epoch_indices(n, epoch, options_.seed);
    const int64_t local = indices.size(0);
    // After a resume, skip this rank's share of the samples the job already consumed.
    const int64_t skip = std::min(local, resume_samples_seen_ / replicas);
    resume_samples_seen_ = 0;
    const int64_t steps = (local - skip + batch - 1) / batch;
    progress.start_epoch(epoch, steps, (local - skip) * replicas);
    state_.model->train();

    const Clock::time_point start = Clock::now();
    double loss_sum = 0;  // sum over samples of the per-sample loss
    double interval_loss = 0;
    int64_t interval_samples = 0;
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t begin = skip + s * batch;
      const int64_t end = std::min(local, begin + batch);
      const at::Tensor batch_indices = indices.slice(0, begin, end);
      const double loss = strategy_->train_step(state_, train.inputs.index_select(0, batch_indices),
                                                train.targets.index_select(0, batch_indices));
      const auto count = static_cast<double>(end - begin);
      loss_sum += loss * count;
      interval_loss += loss * count;
      interval_samples += end - begin;
      const double recent = interval_loss / static_cast<double>(interval_samples);
      const int64_t done = (end - skip) * replicas;
      progress.step(s + 1, done, recent);
      if (options_.log_interval > 0 && (s + 1) % options_.log_interval == 0) {
        const double seconds = seconds_since(start);
        metrics.write(JsonLine()
                          .add("event", "step")
                          .add("epoch", epoch + 1)
                          .add("step", state_.step)
                          .add("samples", done)
                          .add("loss", recent)
                          .add("samples_per_s", seconds > 0 ? done / seconds : 0.0)
                          .add("seconds", seconds));
        interval_loss = 0;
        interval_samples = 0;
      }
      // The end-of-epoch checkpoint follows the last step, so no mid-epoch one there.
      if (checkpoints && options_.checkpoint_every > 0 &&
          state_.step % options_.checkpoint_every == 0 && s + 1 < steps) {
        save_checkpoint(epoch, end * replicas);
      }
      if (options_.stop_after_steps > 0 && state_.step >= options_.stop_after_steps) {
        result.stopped = true;
        return result;
      }
    }
    const double seconds = seconds_since(start);

    std::vector<double> totals{loss_sum, static_cast<double>(local - skip), 0, 0, 0};
    strategy_->synchronize(state_);
    if (test_n > 0) {
      const EvalResult eval =
          evaluate(*state_.model, plain_forward, test_shard, options_.eval_batch_size);
      totals[2] = eval.loss * static_cast<double>(eval.samples);
      totals[3] = std::round(eval.accuracy * static_cast<double>(eval.samples));
      totals[4] = static_cast<double>(eval.samples);
    }
    strategy_->all_reduce_sum(totals);
    totals[0] /= static_cast<double>(strategy_->ranks_per_replica());
    totals[1] /= static_cast<double>(strategy_->ranks_per_replica());
    EpochResult epoch_result;
    epoch_result.epoch = epoch + 1;
    epoch_result.seconds = seconds;
    epoch_result.train_loss = totals[1] > 0 ? totals[0] / totals[1] : NAN;
    epoch_result.samples_per_s = seconds > 0 ? totals[1] / seconds : 0;
    if (totals[4] > 0) {
      epoch_result.test_loss = totals[2] / totals[4];
      epoch_result.test_accuracy = totals[3] / totals[4];
    } else {
      epoch_result.test_loss = NAN;
      epoch_result.test_accuracy = NAN;
    }
    progress.end_epoch(epoch_result);
    metrics.write(JsonLine()
                      .add("event", "epoch")
                      .add("epoch", epoch_result.epoch)
                      .add("train_loss", epoch_result.train_loss)
                      .add("test_loss", epoch_result.test_loss)
                      .add("test_accuracy", epoch_result.test_accuracy)
                      .add("samples_per_s", epoch_result.samples_per_s)
                      .add("seconds", epoch_result.seconds));
    result.epochs.push_back(epoch_result);
    if (checkpoints) save_checkpoint(epoch + 1, 0);
  }
  if (!options_.dump_parameters.empty()) {
    checkpoint::save_state_dict(checkpoint::state_dict(*state_.model),
                                options_.dump_parameters + ".rank" + std::to_string(rank) + ".pt");
  }
  return result;
}

TrainResult run_training(const TrainOptions& options, std::unique_ptr<Strategy> strategy) {
  options.validate();
  if (options.threads > 0) torch::set_num_threads(options.threads);
  // The model first: an unknown name should fail before seconds of data loading.
  std::shared_ptr<models::Model> model = models::create(options.model, options.seed);
  const data::FashionMnist train_set(options.data_dir, /*train=*/true);
  const data::FashionMnist test_set(options.data_dir, /*train=*/false);
  const bool reports = !strategy || strategy->rank() == 0;
  const int world = strategy ? strategy->world_size() : 1;
  if (reports && options.progress != ProgressMode::kNone) {
    int64_t parameters = 0;
    for (const at::Tensor& p : model->parameters()) parameters += p.numel();
    const int64_t train_size = options.train_limit > 0
                                   ? std::min(options.train_limit, train_set.images().size(0))
                                   : train_set.images().size(0);
    const int64_t test_size = options.test_limit > 0
                                  ? std::min(options.test_limit, test_set.images().size(0))
                                  : test_set.images().size(0);
    std::fprintf(stderr,
                 "shoal train: %s (%lld parameters), Fashion-MNIST %lld train / %lld test images "
                 "from %s, batch %lld%s, lr %g, momentum %g, seed %llu, %d process%s x %d "
                 "threads\n",
                 options.model.c_str(), static_cast<long long>(parameters),
                 static_cast<long long>(train_size), static_cast<long long>(test_size),
                 options.data_dir.c_str(), static_cast<long long>(options.batch_size),
                 world > 1 ? " per rank" : "", options.lr, options.momentum,
                 static_cast<unsigned long long>(options.seed), world, world > 1 ? "es" : "",
                 torch::get_num_threads());
    std::fflush(stderr);
  }
  Trainer trainer(options, std::move(model), std::move(strategy));
  if (options.resume) {
    const std::string path = trainer.resume();
    if (reports) {
      std::fprintf(stderr, "shoal train: resumed from %s (epoch %lld, step %lld)\n", path.c_str(),
                   static_cast<long long>(trainer.state().epoch + 1),
                   static_cast<long long>(trainer.state().step));
      std::fflush(stderr);
    }
  }
  return trainer.fit({train_set.images(), train_set.targets()},
                     {test_set.images(), test_set.targets()});
}

}  // namespace shoal::train
