#include "shoal/train/fault_tolerant_ddp_strategy.h"

#include <torch/types.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "parallel/module_sync.h"
#include "shoal/checkpoint/checkpoint_manager.h"
#include "shoal/checkpoint/training_state.h"
#include "shoal/comm/init.h"
#include "shoal/comm/process_group.h"
#include "shoal/comm/store.h"
#include "shoal/env.h"
#include "shoal/error.h"
#include "shoal/log.h"
#include "shoal/train/clip_grad.h"
#include "shoal/train/trainer.h"

namespace shoal::train {
namespace {

// The job's store: the launcher's when it serves one (`shoal run` with fault tolerance), so that
// any rank may die; else rank 0's, which then must outlive the others.
std::unique_ptr<parallel::FaultTolerantManager> join_job(parallel::FaultTolerantOptions options) {
  const comm::RankInfo info = comm::detect_rank_info();
  const bool agent_store = env::flag(env::Var::kFtAgentStore);
  auto store = comm::make_tcp_store(info.master_addr, info.master_port, info.world_size,
                                    info.rank == 0 && !agent_store, options.timeout);
  return std::make_unique<parallel::FaultTolerantManager>(std::move(store), info.rank,
                                                          info.world_size, std::move(options));
}

at::Tensor flat_gradients(const std::vector<at::Tensor>& parameters) {
  std::vector<at::Tensor> flat;
  for (const auto& p : parameters) {
    flat.push_back(p.grad().defined() ? p.grad().reshape({-1}) : torch::zeros({p.numel()}, p.options()));
  }
  return torch::cat(flat);
}

// Why these bounds: an optimizer keeps a few named tensors per parameter (Adam: step, exp_avg,
// exp_avg_sq, max_exp_avg_sq), each as large as its parameter at most; a line of the description
// below is under 100 bytes. A donor that announces more is refused rather than trusted.
constexpr int64_t kMaxStatesPerParameter = 8;
constexpr int64_t kDescriptionBytesPerParameter = kMaxStatesPerParameter * 128;

// The optimizer's state tensors and "index name dtype dim size..." lines describing them.
std::string describe_optimizer_state(const checkpoint::OptimizerState& optimizer,
                                     std::vector<at::Tensor>& tensors) {
  std::ostringstream text;
  for (const auto& [index, named] : optimizer.state) {
    for (const auto& [name, tensor] : named) {
      text << index << " " << name << " " << static_cast<int>(tensor.scalar_type()) << " "
           << tensor.dim();
      for (int64_t size : tensor.sizes()) text << " " << size;
      text << "\n";
      tensors.push_back(tensor.contiguous());
    }
  }
  return text.str();
}

// Empty tensors as `description` says, each checked against the parameter it belongs to.
checkpoint::OptimizerState receive_buffers(const std::string& description,
                                           const std::vector<at::Tensor>& parameters,
                                           std::vector<at::Tensor>& tensors) {
  checkpoint::OptimizerState out;
  std::istringstream lines(description);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream in(line);
    int64_t index = -1, dim = -1;
    int type = -1;
    std::string name;
    in >> index >> name >> type >> dim;
    const bool known = in && index >= 0 && index < static_cast<int64_t>(parameters.size()) &&
                       type >= 0 && type < static_cast<int>(at::ScalarType::NumOptions) &&
                       dim >= 0 && dim <= 8;
    SHOAL_CHECK_T(PeerError, known, "fault tolerance: the donor's optimizer state is malformed: '",
                  line, "'");
    std::vector<int64_t> sizes(static_cast<size_t>(dim));
    for (auto& size : sizes) in >> size;
    const at::Tensor& param = parameters[static_cast<size_t>(index)];
    const bool fits = in && (sizes == param.sizes().vec() || (dim == 0)) &&
                      out.state[index].size() < kMaxStatesPerParameter;
    SHOAL_CHECK_T(PeerError, fits, "fault tolerance: the donor's optimizer state '", name,
                  "' of parameter ", index, " does not fit its shape ", param.sizes(),
                  ": do all ranks train the same model?");
    at::Tensor buffer = at::empty(sizes, param.options().dtype(static_cast<at::ScalarType>(type)));
    out.state[index][name] = buffer;
    tensors.push_back(buffer);
  }
  return out;
}

}  // namespace

FaultTolerantDdpStrategy::FaultTolerantDdpStrategy(parallel::FaultTolerantOptions options)
    : FaultTolerantDdpStrategy(join_job(std::move(options))) {}

FaultTolerantDdpStrategy::FaultTolerantDdpStrategy(
    std::unique_ptr<parallel::FaultTolerantManager> manager)
    : manager_(std::move(manager)) {
  SHOAL_CHECK_T(InvalidArgument, manager_ != nullptr, "FaultTolerantDdpStrategy: no manager given");
  if (const auto path = env::text(env::Var::kFtSampleLog)) {
    const std::string file = *path + ".rank" + std::to_string(manager_->job_rank());
    sample_log_ = std::make_unique<std::ofstream>(file, std::ios::app);
    SHOAL_CHECK_T(InvalidArgument, sample_log_->good(), "SHOAL_FT_SAMPLE_LOG: cannot write ", file);
  }
}

FaultTolerantDdpStrategy::~FaultTolerantDdpStrategy() = default;

void FaultTolerantDdpStrategy::prepare(TrainState& state) {
  Strategy::prepare(state);  // the model's own forward: gradients are reduced after backward
  SHOAL_CHECK_T(InvalidArgument, state.optimizer != nullptr, "--fault-tolerant: no optimizer");
  for (const auto& item : parallel::unique_named_parameters(*state.model)) {
    parameters_.push_back(item.value());
  }
  state_ = &state;
  if (manager_->replacement()) {
    share_state(state);  // from a live peer, not generation 0's start
    return;
  }
  std::vector<at::Tensor> start = parameters_;
  for (const auto& b : state.model->buffers()) start.push_back(b);
  parallel::broadcast_coalesced(*manager_->group(), start);
}

int FaultTolerantDdpStrategy::rank() const { return manager_->replica_rank(); }
int FaultTolerantDdpStrategy::world_size() const { return manager_->num_replicas(); }
comm::ProcessGroup* FaultTolerantDdpStrategy::process_group() { return manager_->group().get(); }

std::string FaultTolerantDdpStrategy::describe() const {
  std::ostringstream text;
  text << "fault tolerant: a failed step is discarded and the survivors go on (at least "
       << manager_->options().min_replicas << " replicas)";
  return text.str();
}

void FaultTolerantDdpStrategy::save_checkpoint(checkpoint::CheckpointManager& checkpoints,
                                               const checkpoint::TrainingState& state) {
  // Retried over the survivors until the save's reduction commits (see the header).
  for (;;) {
    manager_->start_quorum(/*admit=*/false);
    std::string error;
    if (manager_->replica_rank() == 0) {
      try {
        checkpoints.save(state);
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    at::Tensor failed = torch::full({1}, error.empty() ? 0.0 : 1.0, torch::kFloat64);
    manager_->allreduce(failed);
    if (!manager_->should_commit(/*admit=*/false)) continue;
    if (!error.empty()) SHOAL_THROW(CheckpointError, error);
    SHOAL_CHECK_T(CheckpointError, failed.item<double>() == 0, "[rank ", manager_->job_rank(),
                  "] rank ", manager_->members().front(), " failed to save the checkpoint in ",
                  checkpoints.directory(), " (see its error)");
    return;
  }
}

void FaultTolerantDdpStrategy::start_epoch(int64_t size, int64_t epoch, uint64_t seed,
                                           int64_t consumed) {
  order_ = shuffled_indices(size, seed, epoch);
  epoch_ = epoch;
  // A replacement goes on where the donor was in the epoch it joined in.
  if (epoch == joined_epoch_) consumed = std::max(consumed, joined_consumed_);
  joined_epoch_ = -1;
  consumed_ = std::min(consumed, size);
  trained_ = 0;
}

std::optional<at::Tensor> FaultTolerantDdpStrategy::next_share(int64_t batch) {
  const int64_t left = order_.size(0) - consumed_;
  if (left <= 0) return std::nullopt;
  manager_->start_quorum();
  if (!manager_->joined_replicas().empty()) share_state(*state_);
  const int64_t members = manager_->num_replicas();
  const int64_t me = manager_->replica_rank();
  step_take_ = std::min(left, members * batch);
  // Contiguous slices of the step's samples, their sizes differing by at most one.
  const int64_t begin = consumed_ + step_take_ * me / members;
  const int64_t end = consumed_ + step_take_ * (me + 1) / members;
  share_ = order_.slice(0, begin, end);
  committed_ = false;
  return share_;
}

double FaultTolerantDdpStrategy::train_step(TrainState& state, const at::Tensor& inputs,
                                            const at::Tensor& targets) {
  SHOAL_CHECK(!parameters_.empty(), "FaultTolerantDdpStrategy: train_step before prepare()");
  state.optimizer->zero_grad();
  const int64_t count = inputs.defined() ? inputs.size(0) : 0;
  double loss = 0;
  if (count > 0) {
    const at::Tensor value = state.forward_loss ? state.forward_loss(inputs, targets)
                                                : state.loss(state.forward(inputs), targets);
    value.backward();
    loss = value.item<double>();
  }
  // Each rank's mean gradient weighted by its samples, and the samples: the global mean after.
  at::Tensor flat = torch::cat({flat_gradients(parameters_) * static_cast<double>(count),
                                torch::full({1}, static_cast<double>(count), parameters_[0].options())});
  manager_->allreduce(flat);
  const std::string attempt =
      std::to_string(manager_->generation()) + " " + std::to_string(manager_->attempt());
  log_share(attempt);
  committed_ = manager_->should_commit();
  if (!committed_) return loss;
  log_line("C " + attempt);
  set_mean_gradients(flat);
  if (state.max_grad_norm > 0) {
    state.last_grad_norm = clip_grad_norm_(parameters_, state.max_grad_norm);
  }
  state.optimizer->step();
  ++state.step;
  consumed_ += step_take_;
  trained_ += count;
  return loss;
}

// The donor broadcasts, over the generation that admitted the joiners: the position (epoch,
// samples consumed, step), a description of its optimizer's state, then in one coalesced
// broadcast the parameters, buffers, optimizer state tensors and torch's RNG state. A joiner knows
// the model's shapes and checks every size it is told against them before it allocates.
void FaultTolerantDdpStrategy::share_state(TrainState& state) {
  comm::ProcessGroup& group = *manager_->group();
  const int root = manager_->donor_replica_rank();
  const auto& joined = manager_->joined_replicas();
  const bool receiving =
      std::find(joined.begin(), joined.end(), manager_->job_rank()) != joined.end();
  std::vector<at::Tensor> optimizer_tensors;
  std::string description;
  at::Tensor rng = checkpoint::get_rng_state();
  if (!receiving) {
    description = describe_optimizer_state(checkpoint::capture_optimizer(*state.optimizer),
                                           optimizer_tensors);
  }
  at::Tensor header = torch::tensor({epoch_, consumed_, state.step, state.epoch,
                                     static_cast<int64_t>(description.size()), rng.numel()},
                                    torch::kInt64);
  parallel::broadcast_coalesced(group, {header}, root);
  const auto h = header.accessor<int64_t, 1>();
  const int64_t max_description =
      kDescriptionBytesPerParameter * static_cast<int64_t>(parameters_.size());
  SHOAL_CHECK_T(PeerError, h[4] >= 0 && h[4] <= max_description && h[5] == rng.numel(),
                "[rank ", manager_->job_rank(), "] fault tolerance: the donor announces ", h[4],
                " bytes of optimizer state description (at most ", max_description,
                ") and an RNG state of ", h[5], " bytes (this one's: ", rng.numel(), ")");
  at::Tensor text = torch::zeros({h[4]}, torch::kUInt8);
  // The donor's own description only: another member's may differ in length.
  if (manager_->replica_rank() == root) {
    std::memcpy(text.data_ptr(), description.data(), description.size());
  }
  parallel::broadcast_coalesced(group, {text}, root);
  checkpoint::OptimizerState received;
  if (receiving) {
    description.assign(static_cast<const char*>(text.data_ptr()), static_cast<size_t>(h[4]));
    received = receive_buffers(description, parameters_, optimizer_tensors);
  }
  std::vector<at::Tensor> all = parameters_;
  for (const auto& b : state.model->buffers()) all.push_back(b);
  all.insert(all.end(), optimizer_tensors.begin(), optimizer_tensors.end());
  all.push_back(rng);
  parallel::broadcast_coalesced(group, all, root);
  if (receiving) adopt_state(state, received, rng, header);
}

// A joiner: takes on the optimizer state, RNG state and position it received.
void FaultTolerantDdpStrategy::adopt_state(TrainState& state,
                                           const checkpoint::OptimizerState& optimizer,
                                           const at::Tensor& rng, const at::Tensor& header) {
  checkpoint::OptimizerState whole = optimizer;  // with this optimizer's own hyperparameters
  whole.param_groups = checkpoint::capture_optimizer(*state.optimizer).param_groups;
  checkpoint::restore_optimizer(whole, *state.optimizer);
  checkpoint::set_rng_state(rng);
  const auto h = header.accessor<int64_t, 1>();
  joined_epoch_ = h[0];
  joined_consumed_ = h[1];
  state.step = h[2];
  state.epoch = h[3];
  const size_t donor = static_cast<size_t>(manager_->donor_replica_rank());
  log::warn("[rank ", manager_->job_rank(), "] fault tolerance: received the state of rank ",
            manager_->members()[donor], " (epoch ", h[3] + 1, ", step ", h[2], ", ", h[1],
            " samples of the epoch done)");
}

void FaultTolerantDdpStrategy::set_mean_gradients(const at::Tensor& sums) {
  const at::Tensor samples = sums.narrow(0, sums.size(0) - 1, 1);
  int64_t offset = 0;
  for (auto& p : parameters_) {
    p.mutable_grad() = sums.narrow(0, offset, p.numel()).view(p.sizes()) / samples;
    offset += p.numel();
  }
}

void FaultTolerantDdpStrategy::log_share(const std::string& attempt) {
  if (!sample_log_) return;
  std::ostringstream ids;
  const auto share = share_.accessor<int64_t, 1>();
  for (int64_t i = 0; i < share.size(0); ++i) ids << " " << share[i];
  log_line("T " + std::to_string(epoch_) + " " + attempt + ids.str());
}

void FaultTolerantDdpStrategy::log_line(const std::string& line) {
  if (sample_log_) *sample_log_ << line << "\n" << std::flush;
}

void FaultTolerantDdpStrategy::all_reduce_sum(std::vector<double>& values) {
  // Retried over the survivors until a generation's reduction commits.
  // Replacements are admitted at training steps only (see FaultTolerantManager::start_quorum).
  for (;;) {
    manager_->start_quorum(/*admit=*/false);
    at::Tensor sums = torch::tensor(values, torch::kFloat64);
    manager_->allreduce(sums);
    if (!manager_->should_commit(/*admit=*/false)) continue;
    for (size_t i = 0; i < values.size(); ++i) values[i] = sums[static_cast<int64_t>(i)].item<double>();
    return;
  }
}

}  // namespace shoal::train
