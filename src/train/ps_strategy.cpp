#include "shoal/train/ps_strategy.h"

#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include "shoal/error.h"
#include "shoal/train/trainer.h"

namespace shoal::train {
namespace {

// The trainer's optimizer under a parameter server: step() is push + pull; the update itself
// happens on the servers. Its options are SGD's with the run's lr and momentum, so that a
// trainer checkpoint records them as PyTorch's SGD would; the momentum buffers live on the
// servers (and in their shard checkpoints), so it keeps no state.
class PsOptimizer : public torch::optim::Optimizer {
 public:
  PsOptimizer(std::vector<at::Tensor> params, torch::optim::SGDOptions options, ps::Worker* worker)
      : Optimizer({torch::optim::OptimizerParamGroup(std::move(params))},
                  std::make_unique<torch::optim::SGDOptions>(options)),
        worker_(worker),
        base_lr_(options.lr()) {}

  at::Tensor step(LossClosure closure) override {
    at::Tensor loss;
    if (closure) loss = closure();
    // A schedule (the trainer's lr_schedule) changed this group's lr: the servers step with
    // their lr times the same factor.
    const double lr = param_groups().front().options().get_lr();
    worker_->set_lr_factor(base_lr_ > 0 ? lr / base_lr_ : 1.0);
    worker_->step();
    return loss;
  }
  void save(torch::serialize::OutputArchive&) const override {}
  void load(torch::serialize::InputArchive&) override {}

 private:
  ps::Worker* worker_;
  double base_lr_;
};

ps::WorkerOptions options_from_job() {
  const ps::Job job = ps::job_from_env();
  SHOAL_CHECK_T(InvalidArgument, !job.is_server(),
                "PsStrategy: this process is a server (ROLE_NAME=server); run ps::serve()");
  ps::WorkerOptions options;
  options.rank = job.role_rank;
  options.num_workers = job.num_workers;
  options.servers = ps::server_endpoints(job);
  return options;
}

}  // namespace

PsStrategy::PsStrategy() : PsStrategy(options_from_job()) {}

PsStrategy::PsStrategy(ps::WorkerOptions options) : options_(std::move(options)) {
  SHOAL_CHECK_T(InvalidArgument, !options_.servers.empty(), "PsStrategy: no server given");
}

PsStrategy::~PsStrategy() = default;

void PsStrategy::prepare(TrainState& state) {
  Strategy::prepare(state);  // the forward pass is the model's own
  std::vector<std::pair<std::string, at::Tensor>> parameters;
  std::vector<at::Tensor> tensors;
  for (const auto& item : state.model->named_parameters()) {
    parameters.emplace_back(item.key(), item.value());
    tensors.push_back(item.value());
  }
  worker_ = std::make_unique<ps::Worker>(options_, std::move(parameters));
  worker_->init();
  torch::optim::SGDOptions sgd(0);
  if (state.optimizer && !state.optimizer->param_groups().empty()) {
    auto& first = state.optimizer->param_groups().front().options();
    if (auto* given = dynamic_cast<torch::optim::SGDOptions*>(&first)) {
      sgd = *given;
    } else {
      // Adam/AdamW run on the servers; the worker keeps the lr, which schedules scale.
      sgd.lr(first.get_lr());
    }
  }
  state.optimizer = std::make_unique<PsOptimizer>(std::move(tensors), sgd, worker_.get());
}

at::Tensor PsStrategy::epoch_indices(int64_t dataset_size, int64_t epoch, uint64_t seed,
                                     int64_t consumed) {
  return sampler_indices(dataset_size, epoch, seed, rank(), world_size(), exactly_once(),
                         consumed);
}

void PsStrategy::all_reduce_sum(std::vector<double>& values) {
  SHOAL_CHECK(worker_ != nullptr, "PsStrategy: all_reduce_sum before prepare()");
  values = worker_->all_reduce_sum(values);
}

void PsStrategy::synchronize(TrainState& state) {
  SHOAL_CHECK(worker_ != nullptr, "PsStrategy: synchronize before prepare()");
  // The barrier completes only when every live worker has joined it, and a worker joins after
  // its pushes were acknowledged (applied): after it, the servers hold everyone's last update,
  // and servers that save checkpoints have saved it as the shard of this step (the trainer's
  // checkpoint that follows holds the same weights and step).
  worker_->checkpoint_barrier(state.step);
  worker_->pull();
}

}  // namespace shoal::train
