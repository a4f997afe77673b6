#include "shoal/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "shoal/data/fashion_mnist.h"
#include "shoal/error.h"
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
  if (!strategy_) strategy_ = std::make_unique<SingleProcess>();
  state_.model = std::move(model);
  state_.optimizer = std::make_unique<torch::optim::SGD>(
      state_.model->parameters(),
      torch::optim::SGDOptions(options_.lr).momentum(options_.momentum));
}

Trainer::~Trainer() = default;

TrainResult Trainer::fit(const TensorData& train, const TensorData& test) {
  check_data(train, "training");
  if (test.size() > 0) check_data(test, "test");
  const int64_t n =
      options_.train_limit > 0 ? std::min(options_.train_limit, train.size()) : train.size();
  SHOAL_CHECK_T(InvalidArgument, n > 0, "the training set is empty");
  if (!prepared_) {
    strategy_->prepare(state_);
    prepared_ = true;
  }
  const bool reports = strategy_->rank() == 0;
  MetricsWriter metrics(reports ? options_.metrics_path : std::string());
  const int64_t batch = options_.batch_size;
  const int64_t world = strategy_->world_size();
  const int64_t remaining_epochs = options_.epochs - state_.epoch;
  Progress progress(reports ? options_.progress : ProgressMode::kNone, options_.epochs,
                    remaining_epochs * n, options_.log_interval, reports ? stderr : nullptr,
                    reports ? stdout : nullptr);

  TrainResult result;
  for (; state_.epoch < options_.epochs; ++state_.epoch) {
    const int64_t epoch = state_.epoch;
    const at::Tensor indices = strategy_->epoch_indices(n, epoch, options_.seed);
    const int64_t local = indices.size(0);
    const int64_t steps = (local + batch - 1) / batch;
    progress.start_epoch(epoch, steps, local * world);
    state_.model->train();

    const Clock::time_point start = Clock::now();
    double loss_sum = 0;  // sum over samples of the per-sample loss
    double interval_loss = 0;
    int64_t interval_samples = 0;
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t begin = s * batch;
      const int64_t end = std::min(local, begin + batch);
      const at::Tensor batch_indices = indices.slice(0, begin, end);
      const double loss = train_step(state_, train.inputs.index_select(0, batch_indices),
                                     train.targets.index_select(0, batch_indices));
      const auto count = static_cast<double>(end - begin);
      loss_sum += loss * count;
      interval_loss += loss * count;
      interval_samples += end - begin;
      const double recent = interval_loss / static_cast<double>(interval_samples);
      progress.step(s + 1, end * world, recent);
      if (options_.log_interval > 0 && (s + 1) % options_.log_interval == 0) {
        const double seconds = seconds_since(start);
        metrics.write(JsonLine()
                          .add("event", "step")
                          .add("epoch", epoch + 1)
                          .add("step", state_.step)
                          .add("samples", end * world)
                          .add("loss", recent)
                          .add("samples_per_s", seconds > 0 ? end * world / seconds : 0.0)
                          .add("seconds", seconds));
        interval_loss = 0;
        interval_samples = 0;
      }
    }
    const double seconds = seconds_since(start);

    std::vector<double> totals{loss_sum, static_cast<double>(local)};
    strategy_->all_reduce_sum(totals);
    EpochResult epoch_result;
    epoch_result.epoch = epoch + 1;
    epoch_result.seconds = seconds;
    epoch_result.train_loss = totals[0] / totals[1];
    epoch_result.samples_per_s = seconds > 0 ? totals[1] / seconds : 0;
    if (test.size() > 0) {
      const EvalResult eval =
          evaluate(*state_.model, state_.forward, test, options_.eval_batch_size);
      epoch_result.test_loss = eval.loss;
      epoch_result.test_accuracy = eval.accuracy;
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
  if (reports && options.progress != ProgressMode::kNone) {
    int64_t parameters = 0;
    for (const at::Tensor& p : model->parameters()) parameters += p.numel();
    const int64_t train_size = options.train_limit > 0
                                   ? std::min(options.train_limit, train_set.images().size(0))
                                   : train_set.images().size(0);
    std::fprintf(stderr,
                 "shoal train: %s (%lld parameters), Fashion-MNIST %lld train / %lld test images "
                 "from %s, batch %lld, lr %g, momentum %g, seed %llu, %d threads\n",
                 options.model.c_str(), static_cast<long long>(parameters),
                 static_cast<long long>(train_size),
                 static_cast<long long>(test_set.images().size(0)), options.data_dir.c_str(),
                 static_cast<long long>(options.batch_size), options.lr, options.momentum,
                 static_cast<unsigned long long>(options.seed), torch::get_num_threads());
    std::fflush(stderr);
  }
  Trainer trainer(options, std::move(model), std::move(strategy));
  return trainer.fit({train_set.images(), train_set.targets()},
                     {test_set.images(), test_set.targets()});
}

}  // namespace shoal::train
