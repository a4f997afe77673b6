#include "shoal/train/pipeline_strategy.h"

#include <torch/torch.h>

#include <algorithm>

#include "shoal/error.h"
#include "shoal/parallel/distributed_data_parallel.h"
#include "shoal/pipeline/pipeline_checkpoint.h"
#include "shoal/pipeline/pipeline_grid.h"
#include "shoal/pipeline/pipeline_partition.h"
#include "shoal/pipeline/pipeline_sequential.h"
#include "shoal/pipeline/tied_parameters.h"
#include "shoal/train/clip_grad.h"
#include "shoal/train/trainer.h"

namespace shoal::train {
namespace {

bool has_trainable_parameter(const torch::nn::Module& module) {
  const auto params = module.parameters();
  return std::any_of(params.begin(), params.end(),
                     [](const at::Tensor& p) { return p.requires_grad(); });
}

}  // namespace

PipelineStrategy::PipelineStrategy(PipelineStrategyOptions options, const comm::InitOptions& init)
    : PipelineStrategy(std::move(options), comm::init_process_group(init)) {}

PipelineStrategy::PipelineStrategy(PipelineStrategyOptions options,
                                   std::shared_ptr<comm::ProcessGroup> group)
    : options_(std::move(options)), group_(std::move(group)) {
  SHOAL_CHECK_T(InvalidArgument, group_ != nullptr, "PipelineStrategy: no process group given");
  grid_ = std::make_unique<pipeline::PipelineGrid>(group_, options_.stages);
}

PipelineStrategy::~PipelineStrategy() = default;

void PipelineStrategy::prepare(TrainState& state) {
  auto* model = dynamic_cast<models::Model*>(state.model.get());
  SHOAL_CHECK_T(InvalidArgument, model != nullptr,
                "--strategy pipeline splits the built-in models (mlp, cnn, gpt) into stages; for "
                "your own model build a pipeline::Pipeline over a torch::nn::Sequential");
  SHOAL_CHECK_T(InvalidArgument, !state.autocast_dtype,
                "--precision ", *state.autocast_dtype == at::kHalf ? "fp16" : "bf16",
                " is not supported with --strategy pipeline yet; use single, ddp or ps");
  // The stages' backward runs inside the pipeline schedule, which does not scale the loss.
  SHOAL_CHECK_T(InvalidArgument, !state.grad_scaler,
                "a loss scaler (--precision fp16) is not supported with --strategy pipeline yet; "
                "use single, ddp or ps");
  sequential_ = pipeline::as_sequential(*model);
  balance_ = options_.balance.empty()
                 ? pipeline::balance_by_parameters(sequential_, options_.stages)
                 : options_.balance;
  pipeline::check_balance(balance_, static_cast<int64_t>(sequential_->size()));
  pipeline_ = std::make_unique<pipeline::Pipeline>(
      pipeline::stage_module(sequential_, balance_, grid_->stage()), group_, grid_->stage_ranks(),
      options_.pipeline);
  // A stage without parameters (the MLP's Flatten alone) has no gradient to average, and DDP
  // refuses such a module; its replicas agree on this, as they hold the same stage.
  if (grid_->replicas() > 1 && has_trainable_parameter(*pipeline_->module())) {
    ddp_ = std::make_shared<parallel::DistributedDataParallel<torch::nn::SequentialImpl>>(
        pipeline_->module().ptr(), grid_->stage_group());
    pipeline_->set_data_parallel(ddp_);
  }
  tied_ = std::make_unique<pipeline::TiedParameters>(sequential_, balance_, *grid_);
  choose_loss(*model, state);
  state.forward = state.model_forward;
}

void PipelineStrategy::choose_loss(models::Model& model, TrainState& state) {
  if (!model.owns_loss()) {
    loss_ = state.loss;
    return;
  }
  // A model whose own loss its chain cannot give is left without forward_loss: the trainer
  // refuses it in one line.
  models::SequentialLoss own = model.sequential_loss();
  if (!own.loss) return;
  loss_ = std::move(own.loss);
  loss_terms_ = std::move(own.terms);
  // The steps go through the pipeline (train_step); this marks the model's loss as trained.
  state.forward_loss = state.model_loss;
}

at::Tensor PipelineStrategy::epoch_indices(int64_t dataset_size, int64_t epoch, uint64_t seed,
                                           int64_t consumed) {
  return sampler_indices(dataset_size, epoch, seed, grid_->replica(), grid_->replicas(),
                         exactly_once(), consumed);
}

void PipelineStrategy::all_reduce_sum(std::vector<double>& values) {
  train::all_reduce_sum(*group_, values);
}

int PipelineStrategy::rank() const { return group_->rank(); }
int PipelineStrategy::world_size() const { return group_->size(); }

double PipelineStrategy::train_step(TrainState& state, const at::Tensor& inputs,
                                    const at::Tensor& targets) {
  SHOAL_CHECK(pipeline_ != nullptr, "PipelineStrategy: train_step before prepare");
  state.optimizer->zero_grad();
  const double loss = pipeline_->forward_backward(inputs, targets, loss_, loss_terms_);
  tied_->all_reduce_gradients();
  if (state.max_grad_norm > 0) state.last_grad_norm = clip_grad_norm(state, state.max_grad_norm);
  // Parameters of other stages have no gradient: the optimizer leaves them (and their state) alone.
  state.optimizer->step();
  ++state.step;
  // Every rank reports the mean over replicas of its last stage's loss.
  at::Tensor value = at::full({1}, pipeline_->is_last_stage() ? loss : 0.0, at::kDouble);
  group_->allreduce(value)->wait();
  return value.item<double>() / grid_->replicas();
}

double PipelineStrategy::clip_grad_norm(TrainState&, double max_norm) {
  SHOAL_CHECK(pipeline_ != nullptr, "PipelineStrategy: clip_grad_norm before prepare");
  return clip_grad_norm_(pipeline_->module()->parameters(), max_norm, sum_across_ranks(),
                         static_cast<double>(grid_->replicas()), tied_->copies());
}

double PipelineStrategy::grad_norm(TrainState&) {
  SHOAL_CHECK(pipeline_ != nullptr, "PipelineStrategy: grad_norm before prepare");
  return total_grad_norm(pipeline_->module()->parameters(), sum_across_ranks(),
                         static_cast<double>(grid_->replicas()), tied_->copies());
}

SumAcross PipelineStrategy::sum_across_ranks() {
  // The global norm: every stage's squared norm summed over all ranks, where each stage is
  // held by the pipeline's `replicas` data-parallel copies (equal after DDP's averaging), hence
  // the division by `replicas` that clip_grad_norm_ and total_grad_norm make.
  return [this](std::vector<double>& values) { train::all_reduce_sum(*group_, values); };
}

void PipelineStrategy::synchronize(TrainState& state) {
  if (!pipeline_) return;
  pipeline::gather_stages(sequential_, balance_, *grid_, state.optimizer.get());
}

}  // namespace shoal::train
