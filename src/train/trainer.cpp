#include "shoal/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <future>
#include <map>
#include <optional>
#include <sstream>

#include "compat/autocast.h"
#include "compat/thread_parallelism.h"
#include "log/error_file.h"
#include "shoal/checkpoint/checkpoint_manager.h"
#include "shoal/checkpoint/serialization.h"
#include "shoal/checkpoint/sharded_checkpoint.h"
#include "shoal/checkpoint/training_state.h"
#include "shoal/data/cifar10.h"
#include "shoal/data/data_loader.h"
#include "shoal/data/fashion_mnist.h"
#include "shoal/data/image_folder.h"
#include "shoal/data/tensor_file.h"
#include "shoal/data/token_block_dataset.h"
#include "shoal/comm/init.h"
#include "shoal/env.h"
#include "shoal/error.h"
#include "shoal/log.h"
#include "shoal/memory/cpu_allocator.h"
#include "shoal/models/gpt.h"
#include "shoal/models/registry.h"
#include "shoal/summary/summary_writer.h"
#include "shoal/train/clip_grad.h"
#include "shoal/models/script_model.h"
#include "shoal/train/metrics_writer.h"
#include "shoal/train/progress.h"
#include "shoal/trace/tracer.h"

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

/// The optimizer as `shoal train` builds it (make_optimizer); the options are checked first, so
/// that a bad learning rate is reported as the trainer's InvalidArgument rather than LibTorch's.
std::unique_ptr<torch::optim::Optimizer> make_builtin_optimizer(const TrainOptions& options,
                                                                torch::nn::Module* model) {
  options.validate();
  if (model == nullptr) return nullptr;
  return make_optimizer(options, model->parameters());
}

/// Checkpoint config keys of the fp16 loss scaler's state: "grad_scaler.scale", ...
constexpr const char* kScalerPrefix = "grad_scaler.";

/// Writes a metrics line's values as TensorBoard scalars `prefix/<key>` at `step`, except the
/// keys that are the line's coordinates.
void add_scalars_of(summary::SummaryWriter* writer, const JsonLine& line, const char* prefix,
                    int64_t step) {
  if (writer == nullptr) return;
  for (const auto& [key, value] : line.numbers()) {
    if (key == "epoch" || key == "step" || key == "samples" || key == "total_samples" ||
        key == "time" || key == "seconds" || !std::isfinite(value)) {
      continue;
    }
    writer->add_scalar(std::string(prefix) + "/" + key, value, step);
  }
}

/// Each parameter group's learning rate, in order: the schedule's base values.
std::vector<double> group_lrs(const torch::optim::Optimizer& optimizer) {
  std::vector<double> lrs;
  for (const auto& group : optimizer.param_groups()) lrs.push_back(group.options().get_lr());
  return lrs;
}

// Notes the failure of an exception that leaves its scope (log/error_file.h), before the strategy
// and its process group go: their end is what tells the other ranks to fail.
class FailureNote {
 public:
  ~FailureNote() {
    if (std::uncaught_exceptions() > exceptions_) log::note_failure();
  }

 private:
  int exceptions_ = std::uncaught_exceptions();
};

/// The loss a training step minimizes on a batch: the model's own, or `loss` of its output.
at::Tensor batch_loss(TrainState& state, const at::Tensor& inputs, const at::Tensor& targets) {
  if (state.forward_loss) return state.forward_loss(inputs, targets);
  return state.loss(state.forward(inputs), targets);
}

/// One batch's summed loss and correct predictions (-1: accuracy does not apply).
using EvalBatch = std::function<std::pair<double, int64_t>(const at::Tensor& inputs,
                                                           const at::Tensor& targets)>;

/// Evaluates `per_batch` over `data` in batches of `batch_size`, without autograd, with `model`
/// in eval mode; each batch goes to the model's device.
EvalResult evaluate_batches(torch::nn::Module& model, const data::BatchDataset& data,
                            int64_t batch_size, const EvalBatch& per_batch) {
  SHOAL_CHECK_T(InvalidArgument, batch_size >= 1, "evaluate: batch size must be at least 1");
  const bool was_training = model.is_training();
  model.eval();
  // No autograd: nothing of a batch outlives it, so evaluation holds one batch's activations.
  torch::NoGradGuard no_grad;
  double loss_sum = 0;
  int64_t correct = 0;
  bool classification = true;
  const int64_t n = data.size();
  data::DataLoaderOptions loader_options;
  loader_options.batch_size = batch_size;
  data::DataLoader loader(data, at::arange(n, at::kLong), loader_options);
  // The model's device (--device cuda): each batch goes there.
  at::Device device = at::kCPU;
  for (const auto& p : model.parameters()) {
    device = p.device();
    break;
  }
  while (std::optional<data::Batch> batch = loader.next()) {
    const at::Tensor targets = device.is_cpu() ? batch->target : batch->target.to(device);
    const at::Tensor inputs = device.is_cpu() ? batch->data : batch->data.to(device);
    const auto [loss, right] = per_batch(inputs, targets);
    loss_sum += loss;
    classification = classification && right >= 0;
    correct += std::max<int64_t>(right, 0);
  }
  model.train(was_training);
  EvalResult result;
  result.samples = n;
  if (n > 0) {
    result.loss = loss_sum / static_cast<double>(n);
    result.accuracy =
        classification ? static_cast<double>(correct) / static_cast<double>(n) : NAN;
  }
  return result;
}

}  // namespace

double train_step(TrainState& state, const at::Tensor& batch_inputs, const at::Tensor& batch_targets) {
  // A batch on the CPU goes to the model's device (--device cuda, #29).
  const bool on_cpu = state.device.is_cpu();
  const at::Tensor inputs = on_cpu ? batch_inputs : batch_inputs.to(state.device);
  const at::Tensor targets = on_cpu ? batch_targets : batch_targets.to(state.device);
  state.optimizer->zero_grad();
  const int64_t n = inputs.size(0);
  // Gradient accumulation (#29): micro-batches of micro_batch_size, one optimizer step.
  const int64_t micro =
      state.micro_batch_size > 0 && state.micro_batch_size < n ? state.micro_batch_size : n;
  const int64_t chunks = n > 0 ? (n + micro - 1) / micro : 1;
  double value = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * micro;
    const int64_t end = std::min(n, begin + micro);
    // DDP's no_sync on every micro-batch but the last: their gradients add up locally, and the
    // last backward reduces the sum.
    std::shared_ptr<void> no_sync;
    if (c + 1 < chunks && state.no_sync) no_sync = state.no_sync();
    at::Tensor loss;
    {
      trace::Span span("forward");
      compat::CpuAutocastGuard autocast(on_cpu ? state.autocast_dtype : std::nullopt);
      compat::CudaAutocastGuard cuda_autocast(state.device.is_cuda() ? state.autocast_dtype
                                                                     : std::nullopt);
      loss = chunks == 1 ? batch_loss(state, inputs, targets)
                         : batch_loss(state, inputs.slice(0, begin, end),
                                      targets.slice(0, begin, end));
    }
    const double share = chunks == 1 ? 1.0 : static_cast<double>(end - begin) / static_cast<double>(n);
    {
      trace::Span span("backward");  // DDP's bucket reductions run inside it
      at::Tensor scaled = chunks == 1 ? loss : loss * share;
      if (state.grad_scaler) scaled = state.grad_scaler->scale(scaled);
      scaled.backward();
    }
    value += loss.item<double>() * share;
  }
  // fp16: the true gradients before clipping, as in PyTorch's recipe (scaler.unscale_ first).
  if (state.grad_scaler) state.grad_scaler->unscale_(*state.optimizer);
  bool skipped = false;
  if (state.grad_scaler && state.grad_scaler->found_inf()) {
    // The step is skipped: nothing to clip (the norm is not finite; PyTorch's clip would make
    // every gradient NaN, which no step uses).
    state.last_grad_norm = NAN;
  } else if (state.max_grad_norm > 0) {
    state.last_grad_norm =
        state.clip_grad_norm
            ? state.clip_grad_norm(state.max_grad_norm)
            : clip_grad_norm_(state.model ? state.model->parameters() : std::vector<at::Tensor>{},
                              state.max_grad_norm);
  }
  {
    trace::Span span("optimizer step");
    if (state.grad_scaler) {
      // A step with an inf/NaN gradient is skipped and the scale backs off (on every rank).
      skipped = !state.grad_scaler->step(*state.optimizer);
      state.grad_scaler->update();
    } else {
      state.optimizer->step();
    }
  }
  ++state.step;
  // A diverged run must not go on (and exit 0) with NaN weights; stop at the first bad step. Under
  // a loss scaler, a step whose loss overflowed was skipped (the weights are untouched) and the
  // scale backs off, as in PyTorch.
  SHOAL_CHECK(std::isfinite(value) || skipped, "training diverged: the loss is ", value, " at step ",
              state.step, " (epoch ", state.epoch + 1,
              "); lower the learning rate, or check the data for NaN/inf");
  return value;
}

EvalResult evaluate(torch::nn::Module& model,
                    const std::function<at::Tensor(const at::Tensor&)>& forward,
                    const TensorData& data, int64_t batch_size, const LossFunction& loss) {
  if (data.size() == 0) return evaluate(model, forward, data::TensorDataset(at::empty({0}), at::empty({0})), batch_size, loss);
  return evaluate(model, forward, data::TensorDataset(data.inputs, data.targets), batch_size, loss);
}

EvalResult evaluate(torch::nn::Module& model,
                    const std::function<at::Tensor(const at::Tensor&)>& forward,
                    const data::BatchDataset& data, int64_t batch_size, const LossFunction& loss) {
  return evaluate_batches(model, data, batch_size, [&](const at::Tensor& inputs,
                                                       const at::Tensor& targets) {
    const at::Tensor output = forward(inputs);
    // The loss is a batch mean: weighted by the batch's size, the sum is exact over batches.
    const double sum = loss(output, targets).item<double>() * static_cast<double>(targets.size(0));
    const bool classes = !at::isFloatingType(targets.scalar_type()) && output.dim() == 2 &&
                         targets.dim() == 1;
    return std::make_pair(sum, classes ? output.argmax(1).eq(targets).sum().item<int64_t>()
                                       : int64_t{-1});
  });
}

EvalResult evaluate_model_loss(torch::nn::Module& model, const BatchLoss& model_loss,
                               const data::BatchDataset& data, int64_t batch_size) {
  return evaluate_batches(model, data, batch_size, [&](const at::Tensor& inputs,
                                                       const at::Tensor& targets) {
    const double mean = model_loss(inputs, targets).item<double>();
    return std::make_pair(mean * static_cast<double>(targets.size(0)), int64_t{-1});
  });
}

Trainer::Trainer(TrainOptions options, std::shared_ptr<models::Model> model,
                 std::unique_ptr<Strategy> strategy)
    : Trainer(options, model,
              [model](const at::Tensor& input) { return model->forward(input); },
              make_builtin_optimizer(options, model.get()),
              loss_function(options.loss), std::move(strategy)) {
  builtin_optimizer_ = true;
  if (model->owns_loss()) {
    state_.model_loss = [model](const at::Tensor& inputs, const at::Tensor& targets) {
      return model->forward_loss(inputs, targets);
    };
  }
}

Trainer::Trainer(TrainOptions options, std::shared_ptr<torch::nn::Module> module,
                 BatchLoss model_loss, std::unique_ptr<torch::optim::Optimizer> optimizer,
                 std::unique_ptr<Strategy> strategy)
    : Trainer(std::move(options), std::move(module),
              [](const at::Tensor&) -> at::Tensor {
                SHOAL_THROW(InvalidArgument, "Trainer: this model computes its own loss from "
                            "inputs and targets; it has no forward of inputs alone");
              },
              std::move(optimizer), cross_entropy_loss, std::move(strategy)) {
  SHOAL_CHECK_T(InvalidArgument, model_loss != nullptr, "Trainer: no model loss given");
  state_.model_loss = std::move(model_loss);
}

Trainer::Trainer(TrainOptions options, std::shared_ptr<torch::nn::Module> module,
                 std::function<at::Tensor(const at::Tensor&)> forward,
                 std::unique_ptr<torch::optim::Optimizer> optimizer, LossFunction loss,
                 std::unique_ptr<Strategy> strategy)
    : options_(std::move(options)), strategy_(std::move(strategy)) {
  options_.validate();
  SHOAL_CHECK_T(InvalidArgument, module != nullptr, "Trainer: no model given");
  SHOAL_CHECK_T(InvalidArgument, forward != nullptr, "Trainer: no forward function given");
  SHOAL_CHECK_T(InvalidArgument, optimizer != nullptr, "Trainer: no optimizer given");
  SHOAL_CHECK_T(InvalidArgument, loss != nullptr, "Trainer: no loss function given");
  memory::tune_cpu_allocator();  // steps reuse freed memory instead of faulting it in again
  if (!strategy_) strategy_ = std::make_unique<SingleProcess>();
  state_.model = std::move(module);
  state_.model_forward = std::move(forward);
  state_.optimizer = std::move(optimizer);
  state_.loss = std::move(loss);
  // Taken before a resume() can load a checkpoint's (scheduled) lrs into the optimizer.
  base_lrs_ = group_lrs(*state_.optimizer);
  // --device cuda (#29): the parameters move in place (the optimizer keeps the same tensors),
  // before a resume loads into them and before the strategy broadcasts them.
  state_.device = resolve_device(options_.device);
  if (!state_.device.is_cpu()) {
    const std::string name = strategy_->name();
    SHOAL_CHECK_T(InvalidArgument, name == "single" || name == "ddp", "--device ", options_.device,
                  ": --strategy ", name, " trains on the CPU here; use --strategy single or ddp on a GPU");
    state_.model->to(state_.device);
  }
}

void Trainer::prepare_strategy() {
  strategy_->prepare(state_);
  prepared_ = true;
  SHOAL_CHECK_T(InvalidArgument, !state_.model_loss || state_.forward_loss, "--strategy ",
                strategy_->name(), " does not train a model that computes its own loss (",
                options_.model, "); use --strategy single, ddp, fsdp or ps");
  // The parameter server's strategy replaces the optimizer by one group with the first
  // group's lr; with several groups given, its own lr is the base.
  if (base_lrs_.size() != state_.optimizer->param_groups().size()) {
    base_lrs_ = group_lrs(*state_.optimizer);
  }
}

void Trainer::apply_lr_schedule(int64_t total_steps) {
  // Without a schedule, the optimizer's lr is the user's business.
  if (options_.lr_schedule == "constant" && options_.warmup_steps == 0) return;
  const double factor = lr_schedule_factor(options_, state_.step, total_steps);
  auto& groups = state_.optimizer->param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    groups[g].options().set_lr(base_lrs_.at(g) * factor);
  }
}

Trainer::~Trainer() = default;

checkpoint::TrainingState load_resume_checkpoint(const TrainOptions& options, std::string* path) {
  SHOAL_CHECK_T(InvalidArgument, !options.checkpoint_dir.empty(),
                "--resume needs --checkpoint-dir DIR: the folder to resume from");
  // Falls back past damaged checkpoints to the newest intact one, saying which and why.
  std::optional<checkpoint::ResumePoint> point = checkpoint::load_latest_intact(options.checkpoint_dir);
  SHOAL_CHECK_T(CheckpointError, point.has_value(), "--resume: no checkpoint in ",
                options.checkpoint_dir, "; run without --resume to start from scratch");
  if (!point->skipped.empty() && comm::detect_rank_info().rank == 0) {
    for (const auto& why : point->skipped) log::warn("shoal: --resume skips ", why);
    log::warn("shoal: --resume falls back to ", point->path, ", the newest intact checkpoint");
  }
  const std::optional<std::string> latest = point->path;
  checkpoint::TrainingState saved = std::move(point->state);
  const std::string saved_model = checkpoint::config_text(saved, "model", "unknown");
  SHOAL_CHECK_T(CheckpointError, saved_model == options.model, "--resume: ", *latest,
                " is a checkpoint of model '", saved_model, "', not '", options.model,
                "'; pass --model ", saved_model, " or another --checkpoint-dir");
  if (path != nullptr) *path = *latest;
  return saved;
}

namespace {

/// A number as text that reads back to the same double ("0.050000000000000003" for 0.05 would be
/// exact too, but %.17g keeps short values short only when they are exact; use the shortest that
/// round-trips).
std::string number_text(double value) {
  char text[32];
  for (int digits = 6; digits <= 17; ++digits) {
    std::snprintf(text, sizeof(text), "%.*g", digits, value);
    if (std::strtod(text, nullptr) == value) break;
  }
  return text;
}

}  // namespace

namespace {

/// inherit_checkpoint_config for the options of #29 (checkpoints written before them have none
/// of these keys, and keep the defaults); run_training's options.validate() checks the values.
void inherit_training_features(TrainOptions& options, const checkpoint::TrainingState& saved,
                               const std::set<std::string>& given, const std::string& who) {
  using checkpoint::config_integer;
  using checkpoint::config_number;
  const auto integer = [&](const char* key, int64_t& value) {
    if (auto v = config_integer(saved, key, who); v && !given.count(key)) value = *v;
  };
  const auto number = [&](const char* key, double& value) {
    if (auto v = config_number(saved, key, who); v && !given.count(key)) value = *v;
  };
  integer("warmup_steps", options.warmup_steps);
  number("warmup_start_factor", options.warmup_start_factor);
  integer("step_size", options.step_size);
  number("gamma", options.gamma);
  integer("t_max", options.t_max);
  number("clip_grad_norm", options.clip_grad_norm);
  integer("accumulate", options.accumulate);
  if (!given.count("precision")) {
    options.precision = checkpoint::config_text(saved, "precision", options.precision);
  }
  if (!given.count("loss") && saved.config.count("loss")) {
    const std::string loss = checkpoint::config_text(saved, "loss");
    const std::vector<std::string> known = loss_names();
    SHOAL_CHECK_T(CheckpointError, std::find(known.begin(), known.end(), loss) != known.end(), who,
                  " has loss '", loss, "', which this build does not know; pass --loss");
    options.loss = parse_loss(loss);
  }
  if (!given.count("milestones") && saved.config.count("milestones")) {
    options.milestones.clear();
    std::istringstream text(checkpoint::config_text(saved, "milestones"));
    for (std::string item; std::getline(text, item, ',');) {
      char* end = nullptr;
      const long long value = std::strtoll(item.c_str(), &end, 10);
      SHOAL_CHECK_T(CheckpointError, !item.empty() && end != nullptr && *end == '\0', who,
                    " has milestones '", checkpoint::config_text(saved, "milestones"),
                    "', not optimizer steps A,B,...");
      options.milestones.push_back(value);
    }
  }
}

}  // namespace

void inherit_checkpoint_config(TrainOptions& options, const checkpoint::TrainingState& saved,
                               const std::set<std::string>& given, const std::string& where) {
  using checkpoint::config_integer;
  using checkpoint::config_number;
  const std::string who = "--resume: " + where;
  // Hyper-parameters the command line did not set continue as the checkpoint had them; the ones
  // it set win (and run_training reports the change).
  if (auto lr = config_number(saved, "lr", who); lr && !given.count("lr")) options.lr = *lr;
  if (auto m = config_number(saved, "momentum", who); m && !given.count("momentum")) {
    options.momentum = *m;
  }
  if (!given.count("lr_schedule")) {
    options.lr_schedule = checkpoint::config_text(saved, "lr_schedule", options.lr_schedule);
    SHOAL_CHECK_T(CheckpointError, known_lr_schedule(options.lr_schedule), "--resume: ", where,
                  " has lr_schedule '", options.lr_schedule,
                  "', which this build does not know; pass --lr-schedule constant or cosine");
  }
  if (!given.count("optimizer")) {
    // The optimizer the state was saved by (#29); older checkpoints were all SGD's.
    options.optimizer = checkpoint::config_text(saved, "optimizer", "sgd");
    SHOAL_CHECK_T(CheckpointError,
                  options.optimizer == "sgd" || options.optimizer == "adam" || options.optimizer == "adamw",
                  "--resume: ", where, " has optimizer '", options.optimizer,
                  "', which this build does not know; pass --optimizer sgd, adam or adamw");
  }
  inherit_training_features(options, saved, given, who);
  if (auto b = config_integer(saved, "batch_size", who); b && !given.count("batch_size")) {
    SHOAL_CHECK_T(CheckpointError, *b >= 1 && *b <= 1e9, "--resume: ", where,
                  " has batch_size ", *b);
    options.batch_size = static_cast<int64_t>(*b);
  }
  if (auto e = config_integer(saved, "epochs", who); e && !given.count("epochs")) {
    SHOAL_CHECK_T(CheckpointError, *e >= 1 && *e <= 1e9, "--resume: ", where, " has epochs ", *e);
    options.epochs = static_cast<int64_t>(*e);
  }
  // The seed fixes the order of the samples: another one cannot continue the same epochs.
  if (auto seed = config_integer(saved, "seed", who)) {
    const auto saved_seed = static_cast<uint64_t>(*seed);
    SHOAL_CHECK_T(InvalidArgument, !given.count("seed") || options.seed == saved_seed,
                  "--resume: ", where, " was trained with --seed ", saved_seed,
                  "; --seed ", options.seed,
                  " would change the order of the samples it continues; drop --seed or start "
                  "without --resume");
    options.seed = saved_seed;
  }
}

trace::Recorder* Trainer::recorder() {
  if (options_.trace_path.empty()) return nullptr;
  if (!recorder_) recorder_ = std::make_unique<trace::Recorder>(strategy_->rank());
  return recorder_.get();
}

std::string Trainer::resume() {
  std::string path;
  trace::ScopedRecorder tracing(recorder());
  trace::Span span("checkpoint load", "checkpoint");
  const checkpoint::TrainingState saved = load_resume_checkpoint(options_, &path);
  checkpoint::restore(saved, *state_.model, state_.optimizer.get());
  state_.epoch = saved.epoch;
  state_.step = saved.step;
  // fp16: the scaler goes on from the saved scale and growth tracker.
  std::map<std::string, double> scaler_state;
  for (const auto& [key, value] : saved.config) {
    if (key.rfind(kScalerPrefix, 0) != 0) continue;
    if (auto v = checkpoint::config_number(saved, key, path)) {
      scaler_state[key.substr(std::strlen(kScalerPrefix))] = *v;
    }
  }
  state_.grad_scaler.reset();
  if (!scaler_state.empty()) pending_scaler_state_ = scaler_state;
  // A checkpoint saved at the end of an epoch has samples_seen 0 for the next one.
  resume_samples_seen_ = saved.sampler.epoch == saved.epoch ? saved.sampler.samples_seen : 0;
  resume_changes_.clear();
  if (builtin_optimizer_) {
    // The restored optimizer carries the checkpoint's lr and momentum; the options' apply.
    for (auto& group : state_.optimizer->param_groups()) {
      group.options().set_lr(options_.lr);
      if (auto* sgd = dynamic_cast<torch::optim::SGDOptions*>(&group.options())) {
        sgd->momentum(options_.momentum);
      }
    }
  }
  const auto note = [&](const char* key, double now) {
    const std::optional<double> before = checkpoint::config_number(saved, key, path);
    if (before && *before != now) {
      resume_changes_ += std::string(resume_changes_.empty() ? "" : ", ") + key + " " +
                         checkpoint::config_text(saved, key) + " -> " + number_text(now);
    }
  };
  note("lr", options_.lr);
  note("momentum", options_.momentum);
  const std::string saved_schedule = checkpoint::config_text(saved, "lr_schedule", "constant");
  if (saved_schedule != options_.lr_schedule) {
    resume_changes_ += std::string(resume_changes_.empty() ? "" : ", ") + "lr_schedule " +
                       saved_schedule + " -> " + options_.lr_schedule;
  }
  note("batch_size", static_cast<double>(options_.batch_size));
  note("epochs", static_cast<double>(options_.epochs));
  return path;
}

void Trainer::save_checkpoint(int64_t completed_epochs, int64_t samples_seen) {
  trace::Span span("checkpoint save", "checkpoint");
  checkpoint::CheckpointManagerOptions manager_options;
  manager_options.keep_last = options_.checkpoint_keep;
  checkpoint::CheckpointManager manager(options_.checkpoint_dir, manager_options);
  const bool sharded = options_.checkpoint_format == "sharded";
  checkpoint::ShardedTrainingState pieces;
  if (sharded) {
    // Each rank's own pieces, nothing gathered.
    SHOAL_CHECK_T(InvalidArgument, strategy_->sharded_checkpoint(state_, pieces),
                  "--checkpoint-format sharded: --strategy ", strategy_->name(),
                  " does not shard the model; use --strategy fsdp or --checkpoint-format full");
  } else {
    strategy_->synchronize(state_);
    pieces.replicated = checkpoint::capture(*state_.model, strategy_->checkpoint_optimizer(state_));
  }
  checkpoint::TrainingState& state = pieces.replicated;
  state.epoch = completed_epochs;
  state.step = state_.step;
  state.sampler.epoch = completed_epochs;
  state.sampler.samples_seen = samples_seen;
  state.sampler.seed = static_cast<int64_t>(options_.seed);
  state.world_size = strategy_->world_size();
  // Numbers as numbers: Python's torch.load gives float and int (older checkpoints held strings).
  state.config = {{"model", options_.model},
                  {"lr", options_.lr},
                  {"momentum", options_.momentum},
                  {"lr_schedule", options_.lr_schedule},
                  {"optimizer", options_.optimizer},
                  {"batch_size", options_.batch_size},
                  {"seed", static_cast<int64_t>(options_.seed)},
                  {"epochs", options_.epochs},
                  {"world_size", static_cast<int64_t>(strategy_->world_size())}};
  // The schedule, clipping, accumulation and precision (#29): a resume continues with them.
  std::string milestones;
  for (int64_t m : options_.milestones) {
    milestones += (milestones.empty() ? "" : ",") + std::to_string(m);
  }
  state.config.insert({{"warmup_steps", options_.warmup_steps},
                       {"warmup_start_factor", options_.warmup_start_factor},
                       {"step_size", options_.step_size},
                       {"gamma", options_.gamma},
                       {"milestones", milestones},
                       {"t_max", options_.t_max},
                       {"clip_grad_norm", options_.clip_grad_norm},
                       {"accumulate", options_.accumulate},
                       {"precision", options_.precision},
                       {"loss", std::string(loss_name(options_.loss))}});
  // The GPT's sizes: what `shoal generate` rebuilds it from.
  if (options_.model == "gpt") {
    const models::GptConfig& gpt = options_.gpt;
    state.config.insert({{"gpt.n_layer", gpt.n_layer},
                         {"gpt.n_head", gpt.n_head},
                         {"gpt.n_embd", gpt.n_embd},
                         {"gpt.block_size", gpt.block_size},
                         {"gpt.vocab_size", gpt.vocab_size},
                         {"gpt.dropout", gpt.dropout}});
    if (is_token_file(options_.data_path)) {
      state.config.insert({"token_dtype", options_.token_dtype});
    }
  }
  // fp16's loss scale (#29), under PyTorch's GradScaler.state_dict() keys.
  if (state_.grad_scaler) {
    for (const auto& [key, value] : state_.grad_scaler->state_dict()) {
      state.config.insert({std::string(kScalerPrefix) + key, value});
    }
  }
  if (sharded) {
    manager.save_sharded(pieces, strategy_->process_group());
  } else {
    manager.save(state, strategy_->process_group());
  }
}

TrainResult Trainer::fit(const TensorData& train, const TensorData& test) {
  check_data(train, "training");
  if (test.size() > 0) check_data(test, "test");
  const data::TensorDataset train_set(train.inputs, train.targets);
  std::optional<data::TensorDataset> test_set;
  if (test.size() > 0) test_set.emplace(test.inputs, test.targets);
  return fit(train_set, test_set ? &*test_set : nullptr);
}

TrainResult Trainer::fit(const data::BatchDataset& train, const data::BatchDataset* test_data) {
  const FailureNote failure_note;
  static const data::TensorDataset kNoTestSet(at::empty({0}), at::empty({0}));
  const data::BatchDataset& test = test_data != nullptr ? *test_data : kNoTestSet;
  const int64_t n =
      options_.train_limit > 0 ? std::min(options_.train_limit, train.size()) : train.size();
  SHOAL_CHECK_T(InvalidArgument, n > 0, "the training set is empty");
  const int64_t test_n =
      options_.test_limit > 0 ? std::min(options_.test_limit, test.size()) : test.size();
  apply_training_features();
  if (!prepared_) prepare_strategy();
  strategy_->set_exactly_once(train.deal_exactly_once());
  const bool reports = strategy_->rank() == 0;
  const bool checkpoints = !options_.checkpoint_dir.empty();
  MetricsWriter metrics(reports ? options_.metrics_path : std::string());
  // One optimizer step takes `accumulate` micro-batches of batch_size (#29).
  const int64_t batch = options_.batch_size * options_.accumulate;
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
  const data::SubsetDataset test_shard(test, test_begin, test_end);

  const Clock::time_point fit_start = Clock::now();
  // This trainer's own timeline, for this thread: trainers on other threads keep theirs.
  std::optional<trace::ScopedRecorder> tracing;
  if (!options_.trace_path.empty()) tracing.emplace(recorder());
  // TensorBoard: the same numbers as the metrics lines, from rank 0 (or every rank).
  std::unique_ptr<summary::SummaryWriter> board;
  if (!options_.tensorboard_dir.empty() && (rank == 0 || options_.tensorboard_all_ranks)) {
    summary::SummaryWriterOptions board_options;
    board_options.flush_secs = 10;  // a TensorBoard watching the run sees it within seconds
    board = std::make_unique<summary::SummaryWriter>(
        options_.tensorboard_all_ranks ? options_.tensorboard_dir + "/rank" + std::to_string(rank)
                                       : options_.tensorboard_dir,
        board_options);
    board->add_text("run",
                    "strategy " + strategy_->name() + ", " + std::to_string(world) +
                        (world == 1 ? " process" : " processes") + ", model " + options_.model +
                        ", batch " + std::to_string(batch) + (world > 1 ? " per rank" : "") +
                        ", lr " + number_text(options_.lr) + ", momentum " +
                        number_text(options_.momentum) + ", lr schedule " + options_.lr_schedule +
                        ", seed " + std::to_string(options_.seed) + ", rank " + std::to_string(rank),
                    state_.step);
  }
  bool described = false;  // the "run" line is written with the first epoch's shard
  std::optional<CommStats> comm_before = strategy_->comm_stats();
  int64_t comm_steps = 0;
  TrainResult result;
  for (; state_.epoch < options_.epochs; ++state_.epoch) {
    const int64_t epoch = state_.epoch;
    const at::Tensor indices = strategy_->epoch_indices(n, epoch, options_.seed);
    const int64_t local = indices.size(0);
    // The samples of an epoch, all replicas together (shards padded, or cut, to equal sizes).
    const int64_t epoch_samples = local * replicas;
    if (!described) {
      // The run's description: what `shoal plot` names the run by and scales its x axes with.
      metrics.write(JsonLine()
                        .add("event", "run")
                        .add("strategy", strategy_->name())
                        .add("world_size", world)
                        .add("model", options_.model)
                        .add("batch_size", batch)
                        .add("global_batch_size", batch * replicas)
                        .add("epochs", options_.epochs)
                        .add("samples_per_epoch", epoch_samples)
                        .add("lr", options_.lr));
      described = true;
    }
    // After a resume, skip this rank's share of the samples the job already consumed.
    const int64_t skip = std::min(local, resume_samples_seen_ / replicas);
    resume_samples_seen_ = 0;
    // This epoch's samples, loaded ahead of the step by the options' workers (#29).
    data::DataLoaderOptions loader_options;
    loader_options.batch_size = batch;
    loader_options.num_workers = options_.num_workers;
    loader_options.prefetch_factor = options_.prefetch_factor;
    train.set_epoch(epoch);  // a dataset's random transforms differ per epoch
    data::DataLoader loader(train, indices.slice(0, skip), loader_options);
    const int64_t steps = loader.num_batches();
    // The schedule's T_max: every step of every epoch of the run, resumed or not.
    const int64_t run_steps = options_.epochs * ((local + batch - 1) / batch);
    progress.start_epoch(epoch, steps, (local - skip) * replicas);
    state_.model->train();

    const Clock::time_point start = Clock::now();
    double loss_sum = 0;  // sum over samples of the per-sample loss
    double interval_loss = 0;
    int64_t interval_samples = 0;
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t begin = skip + s * batch;
      const int64_t end = std::min(local, begin + batch);
      trace::set_step(epoch + 1, state_.step + 1);
      double loss = 0;
      double step_lr = 0;
      {
        trace::Span step_span("train step");
        std::optional<data::Batch> samples;
        {
          trace::Span data_span("data", "data");
          samples = loader.next();
        }
        apply_lr_schedule(run_steps);
        step_lr = state_.optimizer->param_groups().front().options().get_lr();
        loss = strategy_->train_step(state_, samples->data, samples->target);
      }
      ++comm_steps;
      if (!callbacks_.empty()) {
        StepInfo info;
        info.epoch = epoch + 1;
        info.step = state_.step;
        info.loss = loss;
        info.lr = step_lr;
        info.grad_norm = state_.last_grad_norm;
        for (const auto& callback : callbacks_) callback->on_train_batch_end(*this, info);
        // Every process runs its callbacks: they agree to stop after the same step.
        std::vector<double> stop{stop_requested_ ? 1.0 : 0.0};
        strategy_->all_reduce_sum(stop);
        if (stop[0] > 0) {
          if (checkpoints) save_checkpoint(epoch, end * replicas);
          result.early_stopped = true;
          result.step = state_.step;
          write_trace();
          return result;
        }
      }
      const auto count = static_cast<double>(end - begin);
      loss_sum += loss * count;
      interval_loss += loss * count;
      interval_samples += end - begin;
      const double recent = interval_loss / static_cast<double>(interval_samples);
      const int64_t done = (end - skip) * replicas;
      progress.step(s + 1, done, recent);
      if (options_.log_interval > 0 && (s + 1) % options_.log_interval == 0) {
        const double seconds = seconds_since(start);
        JsonLine line;
        line.add("event", "step")
            .add("epoch", epoch + 1)
            .add("step", state_.step)
            .add("samples", done)
            .add("total_samples", epoch * epoch_samples + end * replicas)
            .add("loss", recent)
            .add("samples_per_s", seconds > 0 ? done / seconds : 0.0)
            .add("lr", state_.optimizer->param_groups().front().options().get_lr())
            // Before clipping. Every process builds this line at the same steps, so the norm
            // may be a collective (FSDP's over every rank's shards).
            .add("grad_norm", state_.max_grad_norm > 0 ? state_.last_grad_norm
                                                        : strategy_->grad_norm(state_));
        if (const std::optional<CommStats> now = strategy_->comm_stats(); now && comm_before) {
          // Per step over the interval, this rank's reductions.
          const double per = 1.0 / static_cast<double>(std::max<int64_t>(comm_steps, 1));
          line.add("comm_bytes", (now->bytes - comm_before->bytes) * per)
              .add("comm_wait_s", (now->wait_seconds - comm_before->wait_seconds) * per);
          if (now->bucket_cap_mb > 0) {
            line.add("bucket_cap_mb", now->bucket_cap_mb)
                .add("bucket_cap_tuning", now->bucket_cap_tuning);
          }
          comm_before = now;
        } else if (now) {
          comm_before = now;
        }
        comm_steps = 0;
        line.add("seconds", seconds).add("time", seconds_since(fit_start));
        metrics.write(line);
        add_scalars_of(board.get(), line, "train", state_.step);
        interval_loss = 0;
        interval_samples = 0;
      }
      if (board && options_.histogram_interval > 0 &&
          state_.step % options_.histogram_interval == 0) {
        for (const auto& item : state_.model->named_parameters()) {
          board->add_histogram("parameters/" + item.key(), item.value(), state_.step);
        }
      }
      // The end-of-epoch checkpoint follows the last step, so no mid-epoch one there.
      bool saved = false;
      if (checkpoints && options_.checkpoint_every > 0 &&
          state_.step % options_.checkpoint_every == 0 && s + 1 < steps) {
        save_checkpoint(epoch, end * replicas);
        saved = true;
      }
      if (options_.stop_requested) {
        // Every rank asks, every step, so that all stop after the same step.
        std::vector<double> requested{options_.stop_requested() ? 1.0 : 0.0};
        strategy_->all_reduce_sum(requested);
        if (requested[0] > 0) {
          // A resume continues after the samples consumed so far (all of them at an epoch's end).
          if (checkpoints && !saved) save_checkpoint(epoch, end * replicas);
          result.preempted = true;
          result.step = state_.step;
          write_trace();
          return result;
        }
      }
      if (options_.stop_after_steps > 0 && state_.step >= options_.stop_after_steps) {
        result.stopped = true;
        write_trace();
        return result;
      }
    }
    const double seconds = seconds_since(start);

    std::vector<double> totals{loss_sum, static_cast<double>(local - skip), 0, 0, 0};
    strategy_->synchronize(state_);
    if (test_n > 0) {
      trace::set_step(epoch + 1, state_.step);
      trace::Span eval_span("evaluation", "eval");
      const int64_t eval_batch = options_.eval_batch_size > 0 ? options_.eval_batch_size : batch;
      const EvalResult eval =
          state_.model_loss
              ? evaluate_model_loss(*state_.model, state_.model_loss, test_shard, eval_batch)
              : evaluate(*state_.model, state_.model_forward, test_shard, eval_batch, state_.loss);
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
      // A language model's loss is a mean negative log-likelihood per token.
      if (state_.model_loss) epoch_result.test_perplexity = std::exp(epoch_result.test_loss);
    } else {
      epoch_result.test_loss = NAN;
      epoch_result.test_accuracy = NAN;
    }
    progress.end_epoch(epoch_result);
    JsonLine epoch_line = JsonLine()
                                    .add("event", "epoch")
                                    .add("epoch", epoch_result.epoch)
                                    .add("step", state_.step)
                                    .add("total_samples", (epoch + 1) * epoch_samples)
                                    .add("train_loss", epoch_result.train_loss)
                                    .add("test_loss", epoch_result.test_loss)
                                    .add("test_accuracy", epoch_result.test_accuracy)
                                    .add("samples_per_s", epoch_result.samples_per_s)
                                    .add("seconds", epoch_result.seconds)
                                    .add("time", seconds_since(fit_start));
    if (!std::isnan(epoch_result.test_perplexity)) {
      epoch_line.add("test_perplexity", epoch_result.test_perplexity);
    }
    metrics.write(epoch_line);
    add_scalars_of(board.get(), epoch_line, "epoch", state_.step);
    if (board) board->flush();
    result.epochs.push_back(epoch_result);
    if (checkpoints) save_checkpoint(epoch + 1, 0);
    // The epoch's metrics are the same on every process, so callbacks decide alike on all.
    for (const auto& callback : callbacks_) callback->on_train_epoch_end(*this, epoch_result);
    if (stop_requested_) {
      ++state_.epoch;
      result.early_stopped = true;
      break;
    }
  }
  result.step = state_.step;
  write_trace();
  if (!options_.dump_parameters.empty()) {
    checkpoint::save_state_dict(checkpoint::state_dict(*state_.model),
                                options_.dump_parameters + ".rank" + std::to_string(rank) + ".pt");
  }
  return result;
}

// ---- Optimizer, accumulation, clipping, precision, callbacks (#29) --------------------------------

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainOptions& options,
                                                        const std::vector<at::Tensor>& parameters) {
  options.validate();
  // A tied weight is listed twice by LibTorch: stepping it twice would double its update.
  std::vector<at::Tensor> params = unique_parameters(parameters);
  if (options.optimizer == "adam") {
    return std::make_unique<torch::optim::Adam>(
        params, torch::optim::AdamOptions(options.lr)
                    .betas(std::make_tuple(options.beta1, options.beta2))
                    .eps(options.eps)
                    .weight_decay(options.weight_decay.value_or(0)));
  }
  if (options.optimizer == "adamw") {
    return std::make_unique<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(options.lr)
                    .betas(std::make_tuple(options.beta1, options.beta2))
                    .eps(options.eps)
                    .weight_decay(options.weight_decay.value_or(1e-2)));
  }
  return std::make_unique<torch::optim::SGD>(
      params, torch::optim::SGDOptions(options.lr)
                  .momentum(options.momentum)
                  .weight_decay(options.weight_decay.value_or(0)));
}

void Trainer::apply_training_features() {
  state_.micro_batch_size = options_.accumulate > 1 ? options_.batch_size : 0;
  state_.max_grad_norm = options_.clip_grad_norm;
  if (options_.clip_grad_norm > 0 && !state_.clip_grad_norm) {
    state_.clip_grad_norm = [this](double max_norm) {
      return strategy_->clip_grad_norm(state_, max_norm);
    };
  }
  if (options_.precision == "bf16") {
    state_.autocast_dtype = at::kBFloat16;
  } else if (options_.precision == "fp16") {
    state_.autocast_dtype = at::kHalf;
  } else {
    state_.autocast_dtype.reset();
  }
  const bool scaled = options_.precision == "fp16" || options_.grad_scaler.has_value();
  if (!scaled) {
    state_.grad_scaler.reset();
  } else if (!state_.grad_scaler) {
    state_.grad_scaler =
        std::make_unique<GradScaler>(options_.grad_scaler.value_or(GradScalerOptions{}));
    if (pending_scaler_state_) state_.grad_scaler->load_state_dict(*pending_scaler_state_);
    // Ranks whose gradients differ (pipeline stages, shards) skip a step together.
    state_.grad_scaler->set_found_inf_across(
        [this](std::vector<double>& values) { strategy_->all_reduce_sum(values); });
  }
  pending_scaler_state_.reset();
}

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

void Trainer::write_trace() {
  if (options_.trace_path.empty() || !recorder_) return;
  const int world = strategy_->world_size();
  if (world == 1) {
    trace::write_file(options_.trace_path, recorder_->take_events());
    return;
  }
  // Every rank writes its part; once all have (the allreduce is the barrier), rank 0 merges them.
  const auto part = [&](int r) { return options_.trace_path + ".rank" + std::to_string(r); };
  trace::write_file(part(strategy_->rank()), recorder_->take_events());
  std::vector<double> barrier{1};
  strategy_->all_reduce_sum(barrier);
  if (strategy_->rank() == 0) {
    std::vector<std::string> parts;
    for (int r = 0; r < world; ++r) parts.push_back(part(r));
    trace::merge_files(parts, options_.trace_path);
  }
}

namespace {

/// What run_training trains on (#29).
struct LoadedData {
  std::unique_ptr<data::BatchDataset> train;
  std::unique_ptr<data::BatchDataset> test;
  models::InputShape shape;
  std::string name;   // "Fashion-MNIST", "CIFAR-10", "tensors"
  std::string where;  // the file or folder
};

/// What the --data file must hold for `model` (built before the data, or null): inputs and
/// targets as saved for a model that computes its own loss, else what options.loss takes.
data::TensorFileOptions tensor_file_options(const TrainOptions& options,
                                            const models::Model* model) {
  data::TensorFileOptions file;
  if (const auto* gpt = dynamic_cast<const models::Gpt*>(model)) {
    file.targets = data::TensorFileOptions::Targets::kTokens;
    file.num_classes = gpt->config().vocab_size;
  } else if (model != nullptr && model->owns_loss()) {
    file.targets = data::TensorFileOptions::Targets::kAsSaved;
  } else if (!takes_class_targets(options.loss)) {
    file.targets = data::TensorFileOptions::Targets::kValues;
  } else if (!models::is_script_path(options.model)) {
    // A TorchScript model's classes are its own business (its loss reports a bad label).
    file.num_classes = models::InputShape{}.num_classes;
  }
  return file;
}

/// The built-in models' output width for `targets`: the classes, or each sample's values under a
/// regression loss.
int64_t output_width(const data::TensorFileOptions& file, const at::Tensor& targets) {
  if (file.targets != data::TensorFileOptions::Targets::kValues) {
    return models::InputShape{}.num_classes;
  }
  return targets.size(0) > 0 ? targets.numel() / targets.size(0) : 1;
}

/// A token stream (options.data_path, and val_data_path when set) cut into the GPT's blocks.
LoadedData load_token_data(const TrainOptions& options) {
  data::TokenFileOptions file;
  file.dtype = data::parse_token_dtype(options.token_dtype);
  file.vocab_size = options.gpt.vocab_size;
  const int64_t block = options.gpt.block_size;
  LoadedData loaded;
  loaded.train = std::make_unique<data::TokenBlockDataset>(
      std::make_shared<data::TokenFile>(options.data_path, file), block);
  if (!options.val_data_path.empty()) {
    file.sequential = true;  // evaluation reads the blocks in order
    loaded.test = std::make_unique<data::TokenBlockDataset>(
        std::make_shared<data::TokenFile>(options.val_data_path, file), block);
  } else {
    loaded.test = std::make_unique<data::TensorDataset>(at::empty({0}), at::empty({0}));
  }
  loaded.name = "token blocks";
  loaded.where = options.data_path;
  return loaded;
}

/// A folder of images in options.data_dir, decoded lazily; the built-in model is built to the
/// first image's transformed shape and the folder's number of classes. Without DIR/val or DIR/test
/// the run trains without evaluation.
LoadedData load_image_folders(const TrainOptions& options) {
  data::ImageFolderOptions folder_options = options.image_folder;
  folder_options.seed = options.seed;
  data::ImageFolderSplits splits = data::open_image_folders(options.data_dir, folder_options);
  const at::Tensor first = splits.train->get_batch(at::zeros({1}, at::kLong)).data;
  LoadedData loaded;
  loaded.shape = {first.size(1), first.size(2), first.size(3),
                  static_cast<int64_t>(splits.train->classes().size())};
  loaded.train = std::move(splits.train);
  loaded.test = std::move(splits.test);
  loaded.name = "images";
  loaded.where = options.data_dir;
  return loaded;
}

LoadedData load_data(const TrainOptions& options, const data::TensorFileOptions& file) {
  LoadedData loaded;
  if (is_token_file(options.data_path)) {
    return load_token_data(options);
  } else if (!options.data_path.empty()) {
    data::TensorFileData tensors = data::read_tensor_file(options.data_path, file);
    const int64_t width = output_width(file, tensors.train_y);
    const at::IntArrayRef sample = tensors.train_x.sizes().slice(1);
    if (sample.size() == 3) {
      loaded.shape = {sample[0], sample[1], sample[2], width};
    } else {
      SHOAL_CHECK_T(DataError, options.model != "cnn", options.data_path, ": train_x has shape ",
                    tensors.train_x.sizes(), "; --model cnn takes images [N, C, H, W]");
      int64_t features = 1;
      for (const int64_t d : sample) features *= d;
      loaded.shape = {features, 1, 1, width};
    }
    loaded.train = std::make_unique<data::TensorDataset>(tensors.train_x, tensors.train_y);
    loaded.test = std::make_unique<data::TensorDataset>(tensors.test_x, tensors.test_y);
    loaded.name = "tensors";
    loaded.where = options.data_path;
  } else if (file.targets == data::TensorFileOptions::Targets::kTokens) {
    SHOAL_THROW(InvalidArgument, "--model ", options.model, " trains on blocks of token ids; pass "
                "--data TRAIN.bin [--val-data VAL.bin] (token files, `shoal data tokenize`) or "
                "--data FILE, a torch.save dict of int64 train_x, train_y, test_x, test_y [N, T]");
  } else if (file.targets == data::TensorFileOptions::Targets::kValues) {
    SHOAL_THROW(InvalidArgument, "--loss ", loss_name(options.loss), " takes float targets, but ",
                options.data_dir, " holds class labels; pass --data FILE with float train_y and "
                "test_y, or --loss cross_entropy");
  } else if (data::image_folders_present(options.data_dir)) {
    loaded = load_image_folders(options);
  } else if (data::Cifar10::present(options.data_dir)) {
    loaded.train = std::make_unique<data::Cifar10>(options.data_dir, /*train=*/true);
    loaded.test = std::make_unique<data::Cifar10>(options.data_dir, /*train=*/false);
    loaded.shape = {data::Cifar10::kChannels, data::Cifar10::kRows, data::Cifar10::kCols,
                    data::Cifar10::kNumClasses};
    loaded.name = "CIFAR-10";
    loaded.where = options.data_dir;
  } else {
    // The pixels stay bytes, normalised per batch (FashionMnistBatches: the same floats as
    // FashionMnist's images(), without a pass over 188 MB before the first step). The test split
    // is decoded on a thread of its own while this one decodes the training split (#32): 0.05 s
    // off the start-up on an otherwise idle core. Errors come out as before, the training split's
    // first: the future is waited for (its destructor waits too) before either is reported.
    std::future<std::unique_ptr<data::BatchDataset>> test_split =
        std::async(std::launch::async, [&options]() -> std::unique_ptr<data::BatchDataset> {
          return std::make_unique<data::FashionMnistBatches>(options.data_dir, /*train=*/false,
                                                             options.max_decompression_ratio);
        });
    loaded.train = std::make_unique<data::FashionMnistBatches>(options.data_dir, /*train=*/true,
                                                               options.max_decompression_ratio);
    loaded.test = test_split.get();
    loaded.name = "Fashion-MNIST";
    loaded.where = options.data_dir;
  }
  return loaded;
}

/// A TorchScript model checked against the data on the first batch, so that a model and data
/// that do not fit are one line naming both shapes, not an error deep in the first step. Built-in
/// models are built to the data's shape; a script model brings its own. The forward runs in eval
/// mode without gradients (no BatchNorm statistics move, no dropout draws) and the loss is the
/// trainer's own.
void check_model_fits_data(models::ScriptModel& model, const LoadedData& loaded,
                           const TrainOptions& options) {
  if (loaded.train->size() == 0) return;
  const data::Batch batch = loaded.train->get_batch(
      at::arange(std::min(options.batch_size, loaded.train->size()), at::kLong));
  const std::string first = shoal::detail::str_cat("on the first batch of ", loaded.where, " (inputs ",
                                    batch.data.sizes(), ", targets ", batch.target.sizes(), ")");
  torch::NoGradGuard no_grad;
  const bool training = model.is_training();
  model.train(false);
  at::Tensor output;
  try {
    // A model that computes its own loss is checked whole: its loss must come out of the batch.
    if (model.owns_loss()) {
      model.forward_loss(batch.data, batch.target);
    } else {
      output = model.forward(batch.data);
    }
  } catch (const Error& e) {
    model.train(training);
    SHOAL_THROW(InvalidArgument, e.what(), "; ", first);
  }
  model.train(training);
  if (model.owns_loss()) return;
  try {
    loss_function(options.loss)(output, batch.target);
  } catch (const std::exception& e) {
    std::string labels;
    if (!at::isFloatingType(batch.target.scalar_type()) && batch.target.numel() > 0) {
      labels = shoal::detail::str_cat(" (labels up to ", batch.target.max().item<int64_t>(), ")");
    }
    const auto* error = dynamic_cast<const c10::Error*>(&e);
    std::string why = error ? error->what_without_backtrace() : e.what();
    why = why.substr(0, why.find('\n'));
    SHOAL_THROW(InvalidArgument, model.path(), " returns ", output.sizes(), " for inputs ",
                batch.data.sizes(), " from ", loaded.where, ", which the loss (",
                loss_name(options.loss), ") cannot take with targets ", batch.target.sizes(),
                labels, ": ", why, "; the model must return ",
                takes_class_targets(options.loss) ? "logits [batch, classes] (one per class)"
                                                  : "outputs of the targets' shape",
                " for this data");
  }
}

}  // namespace

TrainResult run_training(const TrainOptions& options, std::unique_ptr<Strategy> strategy) {
  options.validate();
  if (options.threads > 0) compat::set_compute_threads(options.threads);
  // The model's name first: an unknown one should fail before seconds of data loading.
  // A TorchScript file loads here, with its own weights; an unknown name throws, listing the
  // known models. Built-in models that need the data's shape are made once the data is read.
  models::ModelOptions model_options;
  model_options.gpt = options.gpt;
  std::shared_ptr<models::Model> model;
  if (!models::needs_input_shape(options.model)) {
    model = models::create(options.model, options.seed, model_options);
  }
  // The data (#29): a torch.save file of tensors (--data), CIFAR-10's binary files, or
  // Fashion-MNIST's IDX files in data_dir.
  LoadedData loaded = load_data(options, tensor_file_options(options, model.get()));
  model_options.shape = loaded.shape;
  if (!model) model = models::create(options.model, options.seed, model_options);
  if (auto* script = dynamic_cast<models::ScriptModel*>(model.get())) {
    check_model_fits_data(*script, loaded, options);
  }
  if (!options.init_from.empty()) {
    // Any state dict: torch.save(model.state_dict()) from Python, a DDP one ("module." keys are
    // accepted), or a Shoal checkpoint's model. Every key must match.
    checkpoint::load_state_dict(*model, checkpoint::load_state_dict_file(options.init_from));
  }
  const bool reports = !strategy || strategy->rank() == 0;
  const int world = strategy ? strategy->world_size() : 1;
  if (reports && options.progress != ProgressMode::kNone) {
    int64_t parameters = 0;
    for (const at::Tensor& p : model->parameters()) parameters += p.numel();
    const int64_t train_size = options.train_limit > 0
                                   ? std::min(options.train_limit, loaded.train->size())
                                   : loaded.train->size();
    const int64_t test_total = loaded.test ? loaded.test->size() : 0;
    const int64_t test_size =
        options.test_limit > 0 ? std::min(options.test_limit, test_total) : test_total;
    // Doubles go through a stream with its default precision: what printf's %g shows.
    log::info("shoal train: ", options.model, " (", parameters, " parameters), ", loaded.name, " ",
              train_size, " train / ", test_size, " test samples from ", loaded.where,
              ", batch ", options.batch_size, world > 1 ? " per rank" : "", ", lr ", options.lr,
              ", momentum ", options.momentum,
              options.lr_schedule == "constant" ? "" : ", lr schedule " + options.lr_schedule,
              ", seed ", options.seed, ", ", world, " process",
              world > 1 ? "es" : "", " x ", torch::get_num_threads(), " threads",
              strategy && !strategy->describe().empty() ? ", " + strategy->describe() : "");
  }
  // Dropout and every other random layer draw from torch's default generator, which LibTorch
  // seeds at random in each process: seeded here, the same --seed gives the same run (as
  // torch.manual_seed(seed) at the top of a Python script, on every rank). A resumed run puts the
  // checkpoint's generator state back over this.
  torch::manual_seed(options.seed);
  Trainer trainer(options, std::move(model), std::move(strategy));
  // Restarted by `shoal run --max-restarts` (or torchrun) after a worker died: carry on from the
  // last intact checkpoint, when one was written.
  const bool restarted = env::integer(env::Var::kRestartCount).value_or(0) > 0 && !options.checkpoint_dir.empty() &&
                         checkpoint::find_latest(options.checkpoint_dir).has_value();
  if (options.resume || restarted) {
    const std::string path = trainer.resume();
    if (reports) {
      const std::string& changes = trainer.resume_changes();
      log::info("shoal train: resumed from ", path, " (epoch ", trainer.state().epoch + 1, ", step ",
                trainer.state().step, ")", changes.empty() ? "" : "; changed from the checkpoint: ",
                changes);
    }
  }
  return trainer.fit(*loaded.train, loaded.test.get());
}

}  // namespace shoal::train
