#include "train/callbacks.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>

#include "shoal/error.h"
#include "shoal/summary/summary_writer.h"
#include "shoal/train/progress.h"
#include "train/number_text.h"

namespace shoal::train {

bool stopped_mid_epoch(StopReason reason) {
  return reason == StopReason::kCallback || reason == StopReason::kPreempted ||
         reason == StopReason::kStepLimit;
}

// ---- The metrics lines ---------------------------------------------------------------------------

MetricLines::MetricLines(const FitInfo& fit) : fit_(fit), comm_before_(fit.strategy.comm_stats()) {}

JsonLine MetricLines::run(int64_t samples_per_epoch) const {
  return JsonLine()
      .add("event", "run")
      .add("strategy", fit_.strategy.name())
      .add("world_size", fit_.strategy.world_size())
      .add("model", fit_.options.model)
      .add("batch_size", fit_.batch)
      .add("global_batch_size", fit_.batch * fit_.replicas)
      .add("epochs", fit_.options.epochs)
      .add("samples_per_epoch", samples_per_epoch)
      .add("lr", fit_.options.lr);
}

std::optional<JsonLine> MetricLines::after_step(const StepEnd& step) {
  ++comm_steps_;
  const int64_t interval = fit_.options.log_interval;
  if (interval <= 0 || step.index % interval != 0) return std::nullopt;
  TrainState& state = fit_.state;
  const double seconds = seconds_since(step.epoch_start);
  JsonLine line;
  line.add("event", "step")
      .add("epoch", step.epoch + 1)
      .add("step", state.step)
      .add("samples", step.done)
      .add("total_samples", step.total)
      .add("loss", step.loss)
      .add("samples_per_s", seconds > 0 ? step.done / seconds : 0.0)
      .add("lr", state.optimizer->param_groups().front().options().get_lr())
      // Before clipping; every rank builds this line, so the norm may be a collective.
      .add("grad_norm", state.max_grad_norm > 0 ? state.last_grad_norm
                                                : fit_.strategy.grad_norm(state));
  add_comm_stats(line);
  line.add("seconds", seconds).add("time", seconds_since(fit_.start));
  return line;
}

void MetricLines::add_comm_stats(JsonLine& line) {
  const std::optional<CommStats> now = fit_.strategy.comm_stats();
  if (now && comm_before_) {
    // Per step over the interval, this rank's reductions.
    const double per = 1.0 / static_cast<double>(std::max<int64_t>(comm_steps_, 1));
    line.add("comm_bytes", (now->bytes - comm_before_->bytes) * per)
        .add("comm_wait_s", (now->wait_seconds - comm_before_->wait_seconds) * per);
    if (now->bucket_cap_mb > 0) {
      line.add("bucket_cap_mb", now->bucket_cap_mb).add("bucket_cap_tuning", now->bucket_cap_tuning);
    }
  }
  if (now) comm_before_ = now;
  comm_steps_ = 0;
}

JsonLine MetricLines::epoch(const EpochResult& result, int64_t total_samples) const {
  JsonLine line = JsonLine()
                      .add("event", "epoch")
                      .add("epoch", result.epoch)
                      .add("step", fit_.state.step)
                      .add("total_samples", total_samples)
                      .add("train_loss", result.train_loss)
                      .add("test_loss", result.test_loss)
                      .add("test_accuracy", result.test_accuracy)
                      .add("samples_per_s", result.samples_per_s)
                      .add("seconds", result.seconds)
                      .add("time", seconds_since(fit_.start));
  if (!std::isnan(result.test_perplexity)) line.add("test_perplexity", result.test_perplexity);
  return line;
}

namespace {

// ---- Progress on the terminal (rank 0) -----------------------------------------------------------

class ProgressCallback : public LoopCallback {
 public:
  ProgressCallback(const FitInfo& fit, int64_t train_samples)
      : progress_(fit.strategy.rank() == 0 ? fit.options.progress : ProgressMode::kNone,
                  fit.options.epochs,
                  std::max<int64_t>(fit.options.epochs - fit.state.epoch, 0) * train_samples,
                  fit.options.log_interval, fit.strategy.rank() == 0 ? stderr : nullptr,
                  fit.strategy.rank() == 0 ? stdout : nullptr) {}
  void on_epoch_start(const EpochStart& epoch) override {
    progress_.start_epoch(epoch.epoch, epoch.steps, epoch.remaining);
  }
  void on_step_end(const StepEnd& step) override { progress_.step(step.index, step.done, step.loss); }
  void on_epoch_end(const EpochEnd& epoch) override { progress_.end_epoch(epoch.result); }

 private:
  Progress progress_;
};

// ---- The metrics file (rank 0) -------------------------------------------------------------------

class MetricsCallback : public LoopCallback {
 public:
  MetricsCallback(const FitInfo& fit, const MetricLines& lines)
      : writer_(fit.strategy.rank() == 0 ? fit.options.metrics_path : std::string()),
        lines_(lines) {}
  void on_epoch_start(const EpochStart& epoch) override {
    if (described_) return;
    writer_.write(lines_.run(epoch.samples));
    described_ = true;
  }
  void on_step_end(const StepEnd& step) override {
    if (step.line != nullptr) writer_.write(*step.line);
  }
  void on_epoch_end(const EpochEnd& epoch) override { writer_.write(epoch.line); }

 private:
  MetricsWriter writer_;
  const MetricLines& lines_;
  bool described_ = false;  // the "run" line is written at the first epoch's start
};

// ---- TensorBoard (rank 0, or every rank) ---------------------------------------------------------

/// Writes a metrics line's values as TensorBoard scalars `prefix/<key>` at `step`, except the
/// keys that are the line's coordinates.
void add_scalars_of(summary::SummaryWriter& writer, const JsonLine& line, const char* prefix,
                    int64_t step) {
  for (const auto& [key, value] : line.numbers()) {
    if (key == "epoch" || key == "step" || key == "samples" || key == "total_samples" ||
        key == "time" || key == "seconds" || !std::isfinite(value)) {
      continue;
    }
    writer.add_scalar(std::string(prefix) + "/" + key, value, step);
  }
}

/// The run as TensorBoard's text tab shows it.
std::string run_text(const FitInfo& fit) {
  const int world = fit.strategy.world_size();
  const TrainOptions& o = fit.options;
  return "strategy " + fit.strategy.name() + ", " + std::to_string(world) +
         (world == 1 ? " process" : " processes") + ", model " + o.model + ", batch " +
         std::to_string(fit.batch) + (world > 1 ? " per rank" : "") + ", lr " + number_text(o.lr) +
         ", momentum " + number_text(o.momentum) + ", lr schedule " + lr_schedule_name(o.lr_schedule) + ", seed " +
         std::to_string(o.seed) + ", rank " + std::to_string(fit.strategy.rank());
}

class TensorBoardCallback : public LoopCallback {
 public:
  explicit TensorBoardCallback(const FitInfo& fit) : fit_(fit) {
    summary::SummaryWriterOptions options;
    options.flush_secs = 10;  // a TensorBoard watching the run sees it within seconds
    const TrainOptions& o = fit.options;
    writer_ = std::make_unique<summary::SummaryWriter>(
        o.tensorboard_all_ranks ? o.tensorboard_dir + "/rank" + std::to_string(fit.strategy.rank())
                                : o.tensorboard_dir,
        options);
    writer_->add_text("run", run_text(fit), fit.state.step);
  }
  void on_step_end(const StepEnd& step) override {
    const int64_t now = fit_.state.step;
    if (step.line != nullptr) add_scalars_of(*writer_, *step.line, "train", now);
    const int64_t interval = fit_.options.histogram_interval;
    if (interval > 0 && now % interval == 0) {
      for (const auto& item : fit_.state.model->named_parameters()) {
        writer_->add_histogram("parameters/" + item.key(), item.value(), now);
      }
    }
  }
  void on_epoch_end(const EpochEnd& epoch) override {
    add_scalars_of(*writer_, epoch.line, "epoch", fit_.state.step);
    writer_->flush();
  }

 private:
  const FitInfo& fit_;
  std::unique_ptr<summary::SummaryWriter> writer_;
};

// ---- Checkpoints ---------------------------------------------------------------------------------

class CheckpointCallback : public LoopCallback {
 public:
  CheckpointCallback(const FitInfo& fit, std::function<void(int64_t, int64_t)> save)
      : fit_(fit), save_(std::move(save)) {}
  void on_step_end(const StepEnd& step) override {
    // The end-of-epoch checkpoint follows the last step, so no mid-epoch one there.
    const int64_t every = fit_.options.checkpoint_every;
    if (every > 0 && fit_.state.step % every == 0 && !step.last) save(step.epoch, step.seen);
  }
  void on_epoch_end(const EpochEnd& epoch) override { save(epoch.result.epoch, 0); }
  void on_fit_end(const FitEnd& end) override {
    // A run stopped by a callback or a preemption resumes after the samples consumed so far;
    // options.stop_after_steps stops as an interruption would, after the last periodic save.
    const bool asked = end.reason == StopReason::kCallback || end.reason == StopReason::kPreempted;
    if (asked && saved_step_ != fit_.state.step) save(end.epoch, end.seen);
  }

 private:
  void save(int64_t completed_epochs, int64_t samples_seen) {
    save_(completed_epochs, samples_seen);
    saved_step_ = fit_.state.step;
  }

  const FitInfo& fit_;
  std::function<void(int64_t, int64_t)> save_;
  int64_t saved_step_ = -1;  // the step of the latest save
};

// ---- The trace -----------------------------------------------------------------------------------

class TraceCallback : public LoopCallback {
 public:
  TraceCallback(const FitInfo& fit, trace::Recorder* recorder) : fit_(fit), recorder_(recorder) {}
  // This trainer's own timeline, for this thread: trainers on other threads keep theirs.
  void on_fit_start() override { scope_.emplace(recorder_); }
  void on_fit_end(const FitEnd&) override {
    write();
    scope_.reset();
  }

 private:
  /// Writes options.trace_path: every rank's events, merged by rank 0 (all ranks call).
  void write() {
    const std::string& path = fit_.options.trace_path;
    const int world = fit_.strategy.world_size();
    if (world == 1) {
      trace::write_file(path, recorder_->take_events());
      return;
    }
    // Every rank writes its part; once all have (the allreduce is the barrier), rank 0 merges them.
    const auto part = [&](int r) { return path + ".rank" + std::to_string(r); };
    trace::write_file(part(fit_.strategy.rank()), recorder_->take_events());
    std::vector<double> barrier{1};
    fit_.strategy.all_reduce_sum(barrier);
    if (fit_.strategy.rank() != 0) return;
    std::vector<std::string> parts;
    for (int r = 0; r < world; ++r) parts.push_back(part(r));
    trace::merge_files(parts, path);
  }

  const FitInfo& fit_;
  trace::Recorder* recorder_;
  std::optional<trace::ScopedRecorder> scope_;
};

}  // namespace

std::vector<std::unique_ptr<LoopCallback>> make_loop_callbacks(
    const FitInfo& fit, const MetricLines& lines, int64_t train_samples,
    std::function<void(int64_t, int64_t)> save, trace::Recorder* recorder) {
  const TrainOptions& o = fit.options;
  std::vector<std::unique_ptr<LoopCallback>> callbacks;
  callbacks.push_back(std::make_unique<ProgressCallback>(fit, train_samples));
  callbacks.push_back(std::make_unique<MetricsCallback>(fit, lines));
  if (!o.tensorboard_dir.empty() && (fit.strategy.rank() == 0 || o.tensorboard_all_ranks)) {
    callbacks.push_back(std::make_unique<TensorBoardCallback>(fit));
  }
  if (!o.checkpoint_dir.empty()) {
    callbacks.push_back(std::make_unique<CheckpointCallback>(fit, std::move(save)));
  }
  if (!o.trace_path.empty()) callbacks.push_back(std::make_unique<TraceCallback>(fit, recorder));
  return callbacks;
}

// ---- The user's callbacks ------------------------------------------------------------------------

void Trainer::add_callback(std::shared_ptr<Callback> callback) {
  SHOAL_CHECK_T(InvalidArgument, callback != nullptr, "Trainer::add_callback: null callback");
  callbacks_.push_back(std::move(callback));
}

EarlyStopping::EarlyStopping(EarlyStoppingOptions options) : options_(std::move(options)) {
  SHOAL_CHECK_T(InvalidArgument,
                options_.monitor == "test_loss" || options_.monitor == "test_accuracy" ||
                    options_.monitor == "train_loss",
                "EarlyStopping: monitor must be test_loss, test_accuracy or train_loss, got '",
                options_.monitor, "'");
  SHOAL_CHECK_T(InvalidArgument, options_.mode == "min" || options_.mode == "max",
                "EarlyStopping: mode must be min or max, got '", options_.mode, "'");
  SHOAL_CHECK_T(InvalidArgument, options_.patience >= 0, "EarlyStopping: patience must be >= 0, got ",
                options_.patience);
  SHOAL_CHECK_T(InvalidArgument, options_.min_delta >= 0, "EarlyStopping: min_delta must be >= 0, got ",
                options_.min_delta);
}

void EarlyStopping::on_train_epoch_end(Trainer& trainer, const EpochResult& epoch) {
  const double value = options_.monitor == "test_loss"       ? epoch.test_loss
                       : options_.monitor == "test_accuracy" ? epoch.test_accuracy
                                                             : epoch.train_loss;
  SHOAL_CHECK_T(InvalidArgument, !std::isnan(value), "EarlyStopping: the monitored metric '",
                options_.monitor, "' is NaN at epoch ", epoch.epoch,
                " (no test set given?); monitor train_loss or pass a test set");
  const bool improved =
      std::isnan(best_) ||
      (options_.mode == "min" ? value < best_ - options_.min_delta : value > best_ + options_.min_delta);
  if (improved) {
    best_ = value;
    wait_count_ = 0;
    return;
  }
  ++wait_count_;
  if (wait_count_ >= options_.patience) {
    stopped_epoch_ = epoch.epoch;
    trainer.request_stop();
  }
}

}  // namespace shoal::train
