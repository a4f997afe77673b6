#include "shoal/train/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <future>
#include <map>
#include <optional>
#include <sstream>

#include "compat/thread_parallelism.h"
#include "log/error_file.h"
#include "shoal/checkpoint/checkpoint_manager.h"
#include "shoal/checkpoint/dcp.h"
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
#include "shoal/launcher/launch.h"
#include "shoal/log.h"
#include "shoal/memory/cpu_allocator.h"
#include "shoal/models/registry.h"
#include "shoal/train/clip_grad.h"
#include "shoal/models/script_model.h"
#include "shoal/train/train_option_table.h"
#include "shoal/trace/tracer.h"
#include "train/number_text.h"
#include "train/train_loop.h"

namespace shoal::train {
namespace {

void check_data(const TensorData& data, const char* what) {
  SHOAL_CHECK_T(InvalidArgument, data.inputs.defined() && data.targets.defined(), "the ", what,
                " set has no tensors");
  SHOAL_CHECK_T(InvalidArgument, data.inputs.size(0) == data.targets.size(0), "the ", what,
                " set has ", data.inputs.size(0), " inputs but ", data.targets.size(0),
                " targets");
}

/// `options`, checked: the public constructors validate once and build through the private ones.
TrainOptions validated(TrainOptions options) {
  options.validate();
  return options;
}

/// make_optimizer on options that passed validate().
std::unique_ptr<torch::optim::Optimizer> build_optimizer(const TrainOptions& options,
                                                         const std::vector<at::Tensor>& parameters);

/// The optimizer as `shoal train` builds it (make_optimizer). The options were checked before,
/// so that a bad learning rate is reported as the trainer's InvalidArgument rather than LibTorch's.
std::unique_ptr<torch::optim::Optimizer> make_builtin_optimizer(const TrainOptions& options,
                                                                torch::nn::Module* model) {
  if (model == nullptr) return nullptr;
  return build_optimizer(options, model->parameters());
}

/// Checkpoint config keys of the fp16 loss scaler's state: "grad_scaler.scale", ...
constexpr const char* kScalerPrefix = "grad_scaler.";

/// Each parameter group's learning rate, in order: the schedule's base values.
std::vector<double> group_lrs(const torch::optim::Optimizer& optimizer) {
  std::vector<double> lrs;
  for (const auto& group : optimizer.param_groups()) lrs.push_back(group.options().get_lr());
  return lrs;
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
    : Trainer(Validated{}, validated(std::move(options)), std::move(model), std::move(strategy)) {}

Trainer::Trainer(Validated, TrainOptions options, std::shared_ptr<models::Model> model,
                 std::unique_ptr<Strategy> strategy)
    : Trainer(Validated{}, options, model,
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
    : Trainer(Validated{}, validated(std::move(options)), std::move(module), std::move(forward),
              std::move(optimizer), std::move(loss), std::move(strategy)) {}

Trainer::Trainer(Validated, TrainOptions options, std::shared_ptr<torch::nn::Module> module,
                 std::function<at::Tensor(const at::Tensor&)> forward,
                 std::unique_ptr<torch::optim::Optimizer> optimizer, LossFunction loss,
                 std::unique_ptr<Strategy> strategy)
    : options_(std::move(options)), strategy_(std::move(strategy)) {
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
  // --device cuda: the parameters move in place (the optimizer keeps the same tensors),
  // before a resume loads into them and before the strategy broadcasts them.
  state_.device = resolve_device(options_.device);
  if (!state_.device.is_cpu()) {
    check_strategy_device(options_.device, strategy_->trains_on_gpu(), strategy_->name());
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
  if (options_.lr_schedule == LrSchedule::kConstant && options_.warmup_steps == 0) return;
  const double factor = lr_schedule_factor(options_, state_.step, total_steps);
  auto& groups = state_.optimizer->param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    groups[g].options().set_lr(base_lrs_.at(g) * factor);
  }
}

Trainer::~Trainer() = default;

checkpoint::ResumePoint load_resume_checkpoint(const TrainOptions& options) {
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
  log::debug("shoal: --resume read ", point->path);
  const std::string saved_model = checkpoint::config_text(point->state, "model", "unknown");
  SHOAL_CHECK_T(CheckpointError, saved_model == options.model, "--resume: ", point->path,
                " is a checkpoint of model '", saved_model, "', not '", options.model,
                "'; pass --model ", saved_model, " or another --checkpoint-dir");
  return std::move(*point);
}

trace::Recorder* Trainer::recorder() {
  if (options_.trace_path.empty()) return nullptr;
  if (!recorder_) recorder_ = std::make_unique<trace::Recorder>(strategy_->rank());
  return recorder_.get();
}

std::string Trainer::resume() {
  trace::ScopedRecorder tracing(recorder());
  trace::Span span("checkpoint load", "checkpoint");
  return restore(load_resume_checkpoint(options_));
}

std::string Trainer::resume(checkpoint::ResumePoint point) {
  trace::ScopedRecorder tracing(recorder());
  trace::Span span("checkpoint load", "checkpoint");
  return restore(std::move(point));
}

std::string Trainer::restore(checkpoint::ResumePoint point) {
  const checkpoint::TrainingState& saved = point.state;
  const std::string& path = point.path;
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
  if (builtin_optimizer_) {
    // The restored optimizer carries the checkpoint's lr and momentum; the options' apply.
    for (auto& group : state_.optimizer->param_groups()) {
      group.options().set_lr(options_.lr);
      if (auto* sgd = dynamic_cast<torch::optim::SGDOptions*>(&group.options())) {
        sgd->momentum(options_.momentum);
      }
    }
  }
  resume_changes_ = train_config_changes(options_, saved, path);
  return path;
}

void Trainer::save_checkpoint(int64_t completed_epochs, int64_t samples_seen) {
  trace::Span span("checkpoint save", "checkpoint");
  checkpoint::CheckpointManagerOptions manager_options;
  manager_options.keep_last = options_.checkpoint_keep;
  checkpoint::CheckpointManager manager(options_.checkpoint_dir, manager_options);
  const bool sharded = options_.checkpoint_format == CheckpointFormat::kSharded;
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
  state.config = saved_train_config(options_);
  state.config.insert({"world_size", static_cast<int64_t>(strategy_->world_size())});
  // fp16's loss scale, under PyTorch's GradScaler.state_dict() keys.
  if (state_.grad_scaler) {
    for (const auto& [key, value] : state_.grad_scaler->state_dict()) {
      state.config.insert({std::string(kScalerPrefix) + key, value});
    }
  }
  if (sharded) {
    manager.save_sharded(pieces, strategy_->process_group());
  } else {
    strategy_->save_checkpoint(manager, state);
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

TrainResult Trainer::fit(const data::BatchDataset& train, const data::BatchDataset* test) {
  // Before the strategy and its process group go: their end is what tells the other ranks to fail.
  const log::FailureNote failure_note;
  SHOAL_CHECK_T(InvalidArgument, samples_used(options_.train_limit, train.size()) > 0,
                "the training set is empty");
  apply_training_features();
  if (!prepared_) prepare_strategy();
  strategy_->set_exactly_once(train.deal_exactly_once());
  static const data::TensorDataset kNoTestSet(at::empty({0}), at::empty({0}));
  FitLoop loop(*this, train, test != nullptr ? *test : kNoTestSet);
  return loop.run();
}

// ---- Optimizer, accumulation, clipping, precision, callbacks --------------------------------

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainOptions& options,
                                                        const std::vector<at::Tensor>& parameters) {
  options.validate();
  return build_optimizer(options, parameters);
}

namespace {

std::unique_ptr<torch::optim::Optimizer> build_optimizer(const TrainOptions& options,
                                                         const std::vector<at::Tensor>& parameters) {
  // A tied weight is listed twice by LibTorch: stepping it twice would double its update.
  std::vector<at::Tensor> params = unique_parameters(parameters);
  if (options.optimizer == Optimizer::kAdam) {
    return std::make_unique<torch::optim::Adam>(
        params, torch::optim::AdamOptions(options.lr)
                    .betas(std::make_tuple(options.beta1, options.beta2))
                    .eps(options.eps)
                    .weight_decay(options.weight_decay.value_or(0)));
  }
  if (options.optimizer == Optimizer::kAdamW) {
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

}  // namespace

void Trainer::apply_training_features() {
  state_.micro_batch_size = options_.accumulate > 1 ? options_.batch_size : 0;
  state_.max_grad_norm = options_.clip_grad_norm;
  if (options_.clip_grad_norm > 0 && !state_.clip_grad_norm) {
    state_.clip_grad_norm = [this](double max_norm) {
      return strategy_->clip_grad_norm(state_, max_norm);
    };
  }
  if (options_.precision == Precision::kBf16) {
    state_.autocast_dtype = at::kBFloat16;
  } else if (options_.precision == Precision::kFp16) {
    state_.autocast_dtype = at::kHalf;
  } else {
    state_.autocast_dtype.reset();
  }
  const bool scaled = options_.precision == Precision::kFp16 || options_.grad_scaler.has_value();
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

namespace {

/// What run_training trains on.
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
  if (options.model == "gpt") {  // built from options.gpt
    file.targets = data::TensorFileOptions::Targets::kTokens;
    file.num_classes = options.gpt.vocab_size;
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
  file.dtype = options.token_dtype;
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
    // is decoded on a thread of its own while this one decodes the training split: 0.05 s
    // off the start-up on an otherwise idle core. Errors come out in the order of a serial read,
    // the training split's first: the future is waited for (its destructor waits too) before
    // either is reported.
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
void check_model_fits_data(models::Model& model, const LoadedData& loaded,
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
    SHOAL_THROW(InvalidArgument, options.model, " returns ", output.sizes(), " for inputs ",
                batch.data.sizes(), " from ", loaded.where, ", which the loss (",
                loss_name(options.loss), ") cannot take with targets ", batch.target.sizes(),
                labels, ": ", why, "; the model must return ",
                takes_class_targets(options.loss) ? "logits [batch, classes] (one per class)"
                                                  : "outputs of the targets' shape",
                " for this data");
  }
}

// --init-from: the weights of any state dict file (torch.save(model.state_dict()) from Python,
// a DDP one with "module." keys, a Shoal checkpoint's model; every key must match). A DCP folder
// holding the optimizer's state (PyTorch's dcp.save of FSDP2's get_state_dict, or a Shoal sharded
// checkpoint of the DCP layout) gives that state too, returned to start the optimizer as the run
// that saved it would go on: Adam's moments and step count, read in the same pass as the weights.
// Its group options are left out: the run's options apply, as after --resume.
checkpoint::OptimizerState init_from(const std::string& path, torch::nn::Module& model) {
  if (!checkpoint::is_dcp_folder(path)) {
    checkpoint::load_state_dict(model, checkpoint::load_state_dict_file(path));
    return {};
  }
  checkpoint::TrainingState saved = checkpoint::is_sharded_dcp_folder(path)
                                        ? checkpoint::load_sharded_dcp(path)
                                        : checkpoint::load_foreign_dcp_for(path, model.named_parameters());
  checkpoint::load_state_dict(model, saved.model);
  if (saved.optimizer.state.empty()) return {};
  for (auto& group : saved.optimizer.param_groups) group.options.clear();
  return std::move(saved.optimizer);
}

}  // namespace

TrainResult run_training(const TrainOptions& options, std::unique_ptr<Strategy> strategy) {
  options.validate();
  return detail::run_validated_training(options, std::move(strategy));
}

TrainResult detail::run_validated_training(const TrainOptions& options, std::unique_ptr<Strategy> strategy,
                                           std::optional<checkpoint::ResumePoint> resume_from) {
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
  // The data: a torch.save file of tensors (--data), CIFAR-10's binary files, or
  // Fashion-MNIST's IDX files in data_dir.
  LoadedData loaded = load_data(options, tensor_file_options(options, model.get()));
  model_options.shape = loaded.shape;
  if (!model) model = models::create(options.model, options.seed, model_options);
  if (models::is_script_path(options.model)) check_model_fits_data(*model, loaded, options);
  const checkpoint::OptimizerState init_optimizer =
      options.init_from.empty() ? checkpoint::OptimizerState() : init_from(options.init_from, *model);
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
              options.lr_schedule == LrSchedule::kConstant
                  ? ""
                  : std::string(", lr schedule ") + lr_schedule_name(options.lr_schedule),
              ", seed ", options.seed, ", ", world, " process",
              world > 1 ? "es" : "", " x ", torch::get_num_threads(), " threads",
              strategy && !strategy->describe().empty() ? ", " + strategy->describe() : "");
  }
  // Dropout and every other random layer draw from torch's default generator, which LibTorch
  // seeds at random in each process: seeded here, the same --seed gives the same run (as
  // torch.manual_seed(seed) at the top of a Python script, on every rank). A resumed run puts the
  // checkpoint's generator state back over this.
  torch::manual_seed(options.seed);
  Trainer trainer(Trainer::Validated{}, options, std::move(model), std::move(strategy));
  if (!init_optimizer.empty()) checkpoint::restore_optimizer(init_optimizer, *trainer.state().optimizer);
  // Restarted by `shoal run --max-restarts` (or torchrun) after a worker died: carry on from the
  // last intact checkpoint, when one was written.
  const bool restarted = launcher::restart_count() > 0 && !options.checkpoint_dir.empty() &&
                         checkpoint::find_latest(options.checkpoint_dir).has_value();
  if (options.resume || restarted) {
    const std::string path =
        resume_from ? trainer.resume(std::move(*resume_from)) : trainer.resume();
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
