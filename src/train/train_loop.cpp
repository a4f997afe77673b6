#include "train/train_loop.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <utility>

#include "shoal/checkpoint/serialization.h"
#include "shoal/trace/tracer.h"

namespace shoal::train {

int64_t samples_used(int64_t limit, int64_t size) { return limit > 0 ? std::min(limit, size) : size; }

/// The epoch being trained.
struct FitLoop::Epoch {
  int64_t index = 0;      // 0-based
  int64_t samples = 0;    // the epoch's samples, all replicas together (shares padded, or cut)
  int64_t consumed = 0;   // of those, the ones the job consumed before a resume
  int64_t local = 0;      // this rank's samples of the epoch that this fit() trains
  int64_t steps = 0;      // the steps this fit() trains of it
  int64_t run_steps = 0;  // every step of every epoch of the run: the lr schedule's T_max
  std::unique_ptr<data::DataLoader> loader;
  FitClock::time_point start;
  // Losses weighted by samples: the epoch's, and those since the last metrics line.
  double loss_sum = 0;
  double interval_loss = 0;
  int64_t interval_samples = 0;
};

FitLoop::FitLoop(Trainer& trainer, const data::BatchDataset& train, const data::BatchDataset& test)
    : trainer_(trainer),
      options_(trainer.options_),
      strategy_(*trainer.strategy_),
      state_(trainer.state_),
      train_(train),
      train_n_(samples_used(options_.train_limit, train.size())),
      test_n_(samples_used(options_.test_limit, test.size())),
      // Evaluation is sharded: every rank evaluates a contiguous share of the test set through the
      // unwrapped model (no DDP collectives) and the sums are allreduced, so that W ranks evaluate
      // W times faster than rank 0 alone while the others would wait.
      test_shard_(test, test_n_ * strategy_.rank() / strategy_.world_size(),
                  test_n_ * (strategy_.rank() + 1) / strategy_.world_size()),
      // One optimizer step takes `accumulate` micro-batches of batch_size; pipeline stages share
      // their samples, so a replica is ranks_per_replica processes.
      fit_{options_, strategy_, state_, options_.batch_size * options_.accumulate,
           strategy_.world_size() / strategy_.ranks_per_replica()},
      lines_(fit_),
      callbacks_(make_loop_callbacks(
          fit_, lines_, train_n_,
          [&trainer](int64_t epochs, int64_t seen) { trainer.save_checkpoint(epochs, seen); },
          trainer.recorder())) {}

FitLoop::~FitLoop() = default;

TrainResult FitLoop::run() {
  for (const auto& callback : callbacks_) callback->on_fit_start();
  for (const auto& callback : trainer_.callbacks_) callback->on_fit_start(trainer_);
  StopReason reason = StopReason::kNone;
  while (reason == StopReason::kNone && state_.epoch < options_.epochs) reason = run_epoch();
  return finish(reason);
}

StopReason FitLoop::run_epoch() {
  if (StepDealer* dealer = strategy_.step_dealer()) return run_dealt_epoch(*dealer);
  Epoch epoch = start_epoch();
  for (int64_t s = 0; s < epoch.steps; ++s) {
    const StepInfo step = train_one(epoch);
    const StopReason reason = end_step(epoch, s, step);
    if (reason != StopReason::kNone) return reason;
  }
  end_epoch(epoch);
  ++state_.epoch;
  return trainer_.stop_requested_ ? StopReason::kEpochEnd : StopReason::kNone;
}

// An epoch whose steps the strategy deals as they start: how many there are is known at the end
// (a failed step is dealt again); the counts reported are the committed steps'.
StopReason FitLoop::run_dealt_epoch(StepDealer& dealer) {
  Epoch epoch;
  epoch.index = state_.epoch;
  const int64_t global_batch = fit_.batch * fit_.replicas;
  const int64_t resumed = std::min(trainer_.resume_samples_seen_, train_n_);
  trainer_.resume_samples_seen_ = 0;
  dealer.start_epoch(train_n_, epoch.index, options_.seed, resumed);
  // Reported as this rank's even share of the samples the job consumed so far.
  const int64_t share = (train_n_ + fit_.replicas - 1) / fit_.replicas;
  const int64_t skip = resumed / fit_.replicas;
  epoch.samples = share * fit_.replicas;
  epoch.consumed = skip * fit_.replicas;
  epoch.steps = (train_n_ - resumed + global_batch - 1) / global_batch;
  epoch.run_steps = options_.epochs * ((train_n_ + global_batch - 1) / global_batch);
  train_.set_epoch(epoch.index);
  for (const auto& callback : callbacks_) {
    callback->on_epoch_start({epoch.index, epoch.steps, train_n_, train_n_ - resumed});
  }
  state_.model->train();
  epoch.start = FitClock::now();
  for (int64_t s = 0;;) {
    std::optional<at::Tensor> step_share = dealer.next_share(fit_.batch);
    if (!step_share) break;
    const StepInfo step = train_dealt(epoch, *step_share);
    if (!dealer.committed()) continue;
    const int64_t end = std::min(share, dealer.consumed() / fit_.replicas);
    const int64_t begin = std::max(skip, end - step_share->size(0));
    epoch.steps = dealer.consumed() >= train_n_ ? s + 1 : std::max(epoch.steps, s + 2);
    stop_.epoch = epoch.index;
    stop_.seen = dealer.consumed();
    const StopReason reason = agree_to_stop(step);
    if (reason != StopReason::kCallback) {
      report_step(epoch, s, step.loss, end - begin, (end - skip) * fit_.replicas);
    }
    if (reason != StopReason::kNone) return reason;
    ++s;
  }
  // This rank's own samples, which evaluate_epoch() sums over the survivors.
  epoch.local = dealer.trained();
  end_epoch(epoch);
  ++state_.epoch;
  return trainer_.stop_requested_ ? StopReason::kEpochEnd : StopReason::kNone;
}

StepInfo FitLoop::train_dealt(Epoch& epoch, const at::Tensor& share) {
  trace::set_step(epoch.index + 1, state_.step + 1);
  trace::Span step_span("train step");
  data::Batch samples;
  if (share.size(0) > 0) {
    trace::Span data_span("data", "data");
    samples = train_.get_batch(share);
  }
  trainer_.apply_lr_schedule(epoch.run_steps);
  StepInfo step;
  step.epoch = epoch.index + 1;
  step.lr = state_.optimizer->param_groups().front().options().get_lr();
  step.loss = strategy_.train_step(state_, samples.data, samples.target);
  step.step = state_.step;
  step.grad_norm = state_.last_grad_norm;
  return step;
}

FitLoop::Epoch FitLoop::start_epoch() {
  Epoch epoch;
  epoch.index = state_.epoch;
  // The whole epoch's share, for the counts and the lr schedule; after a resume, this rank's
  // share of the rest of the epoch, dealt over the ranks there are now.
  const at::Tensor whole = strategy_.epoch_indices(train_n_, epoch.index, options_.seed, 0);
  const int64_t resumed = trainer_.resume_samples_seen_;
  trainer_.resume_samples_seen_ = 0;
  const at::Tensor indices =
      resumed > 0 ? strategy_.epoch_indices(train_n_, epoch.index, options_.seed, resumed) : whole;
  epoch.samples = whole.size(0) * fit_.replicas;
  epoch.consumed = std::min(resumed, epoch.samples);
  epoch.local = indices.size(0);
  // This epoch's samples, loaded ahead of the step by the options' workers.
  data::DataLoaderOptions loader_options;
  loader_options.batch_size = fit_.batch;
  loader_options.num_workers = options_.num_workers;
  loader_options.prefetch_factor = options_.prefetch_factor;
  train_.set_epoch(epoch.index);  // a dataset's random transforms differ per epoch
  epoch.loader = std::make_unique<data::DataLoader>(train_, indices, loader_options);
  epoch.steps = epoch.loader->num_batches();
  epoch.run_steps = options_.epochs * ((whole.size(0) + fit_.batch - 1) / fit_.batch);
  const EpochStart start{epoch.index, epoch.steps, epoch.samples, epoch.local * fit_.replicas};
  for (const auto& callback : callbacks_) callback->on_epoch_start(start);
  state_.model->train();
  epoch.start = FitClock::now();
  return epoch;
}

StepInfo FitLoop::train_one(Epoch& epoch) {
  trace::set_step(epoch.index + 1, state_.step + 1);
  trace::Span step_span("train step");
  std::optional<data::Batch> samples;
  {
    trace::Span data_span("data", "data");
    samples = epoch.loader->next();
  }
  trainer_.apply_lr_schedule(epoch.run_steps);
  StepInfo step;
  step.epoch = epoch.index + 1;
  step.lr = state_.optimizer->param_groups().front().options().get_lr();
  step.loss = strategy_.train_step(state_, samples->data, samples->target);
  step.step = state_.step;
  step.grad_norm = state_.last_grad_norm;
  return step;
}

StopReason FitLoop::end_step(Epoch& epoch, int64_t index, const StepInfo& step) {
  const int64_t begin = index * fit_.batch;
  const int64_t end = std::min(epoch.local, begin + fit_.batch);
  // A stop after this step resumes after the samples consumed so far (all, at an epoch's end).
  stop_.epoch = epoch.index;
  stop_.seen = epoch.consumed + end * fit_.replicas;
  const StopReason reason = agree_to_stop(step);
  // A callback's stop ends the run at this step's end, before the step is reported.
  if (reason != StopReason::kCallback) {
    report_step(epoch, index, step.loss, end - begin, end * fit_.replicas);
  }
  return reason;
}

StopReason FitLoop::agree_to_stop(const StepInfo& step) {
  const auto& users = trainer_.callbacks_;
  for (const auto& callback : users) callback->on_train_batch_end(trainer_, step);
  const bool polled = static_cast<bool>(options_.stop_requested);
  if (!users.empty() || polled) {
    // Every process asks at every step, in one all-reduce, so that all stop after the same step.
    std::vector<double> votes{!users.empty() && trainer_.stop_requested_ ? 1.0 : 0.0,
                              polled && options_.stop_requested() ? 1.0 : 0.0};
    strategy_.all_reduce_sum(votes);
    if (votes[0] > 0) return StopReason::kCallback;
    if (votes[1] > 0) return StopReason::kPreempted;
  }
  if (options_.stop_after_steps > 0 && state_.step >= options_.stop_after_steps) {
    return StopReason::kStepLimit;
  }
  return StopReason::kNone;
}

void FitLoop::report_step(Epoch& epoch, int64_t index, double loss, int64_t count, int64_t done) {
  epoch.loss_sum += loss * static_cast<double>(count);
  epoch.interval_loss += loss * static_cast<double>(count);
  epoch.interval_samples += count;
  StepEnd step;
  step.epoch = epoch.index;
  step.index = index + 1;
  step.last = index + 1 == epoch.steps;
  step.done = done;
  step.seen = epoch.consumed + done;
  step.total = epoch.index * epoch.samples + step.seen;
  step.loss = epoch.interval_loss / static_cast<double>(epoch.interval_samples);
  step.epoch_start = epoch.start;
  const std::optional<JsonLine> line = lines_.after_step(step);
  if (line) {
    step.line = &*line;
    epoch.interval_loss = 0;
    epoch.interval_samples = 0;
  }
  for (const auto& callback : callbacks_) callback->on_step_end(step);
}

void FitLoop::end_epoch(const Epoch& epoch) {
  const EpochResult result = evaluate_epoch(epoch, seconds_since(epoch.start));
  const JsonLine line = lines_.epoch(result, (epoch.index + 1) * epoch.samples);
  for (const auto& callback : callbacks_) callback->on_epoch_end({result, line});
  result_.epochs.push_back(result);
  for (const auto& callback : trainer_.callbacks_) callback->on_train_epoch_end(trainer_, result);
}

EpochResult FitLoop::evaluate_epoch(const Epoch& epoch, double seconds) {
  std::vector<double> totals{epoch.loss_sum, static_cast<double>(epoch.local), 0, 0, 0};
  strategy_.synchronize(state_);
  if (test_n_ > 0) {
    const EvalResult eval = evaluate_shard(epoch.index);
    totals[2] = eval.loss * static_cast<double>(eval.samples);
    totals[3] = std::round(eval.accuracy * static_cast<double>(eval.samples));
    totals[4] = static_cast<double>(eval.samples);
  }
  strategy_.all_reduce_sum(totals);
  // Pipeline stages each counted their replica's samples.
  totals[0] /= static_cast<double>(strategy_.ranks_per_replica());
  totals[1] /= static_cast<double>(strategy_.ranks_per_replica());
  EpochResult result;
  result.epoch = epoch.index + 1;
  result.seconds = seconds;
  result.train_loss = totals[1] > 0 ? totals[0] / totals[1] : NAN;
  result.samples_per_s = seconds > 0 ? totals[1] / seconds : 0;
  result.test_loss = totals[4] > 0 ? totals[2] / totals[4] : NAN;
  result.test_accuracy = totals[4] > 0 ? totals[3] / totals[4] : NAN;
  // A language model's loss is a mean negative log-likelihood per token.
  if (totals[4] > 0 && state_.model_loss) result.test_perplexity = std::exp(result.test_loss);
  return result;
}

EvalResult FitLoop::evaluate_shard(int64_t epoch) {
  trace::set_step(epoch + 1, state_.step);
  trace::Span eval_span("evaluation", "eval");
  const int64_t batch = options_.eval_batch_size > 0 ? options_.eval_batch_size : fit_.batch;
  if (state_.model_loss) {
    return evaluate_model_loss(*state_.model, state_.model_loss, test_shard_, batch);
  }
  return evaluate(*state_.model, state_.model_forward, test_shard_, batch, state_.loss);
}

TrainResult FitLoop::finish(StopReason reason) {
  result_.early_stopped = reason == StopReason::kCallback || reason == StopReason::kEpochEnd;
  result_.preempted = reason == StopReason::kPreempted;
  result_.stopped = reason == StopReason::kStepLimit;
  result_.step = state_.step;
  stop_.reason = reason;
  // The caller gets the whole trained model, as after an epoch's evaluation (a strategy that
  // trains parts of it, pipeline stages or tensor-parallel shards, holds it whole only then).
  if (stopped_mid_epoch(reason)) strategy_.synchronize(state_);
  for (const auto& callback : callbacks_) callback->on_fit_end(stop_);
  // The weights of a run that trained to its end, for comparison with another implementation's;
  // a run stopped inside an epoch is not one.
  if (!stopped_mid_epoch(reason) && !options_.dump_parameters.empty()) {
    const std::string rank = std::to_string(strategy_.rank());
    checkpoint::save_state_dict(checkpoint::state_dict(*state_.model),
                                options_.dump_parameters + ".rank" + rank + ".pt");
    // Fault tolerance: a replacement's optimizer state must equal the others' too.
    if (strategy_.step_dealer() != nullptr && state_.optimizer) {
      checkpoint::TrainingState optimizer_only;
      optimizer_only.optimizer = checkpoint::capture_optimizer(*state_.optimizer);
      checkpoint::save_training_state(optimizer_only,
                                      options_.dump_parameters + ".optimizer.rank" + rank + ".pt");
    }
  }
  for (const auto& callback : trainer_.callbacks_) callback->on_fit_end(trainer_, result_);
  return std::move(result_);
}

}  // namespace shoal::train
