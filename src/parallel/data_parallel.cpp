#include "shoal/parallel/data_parallel.h"

#include <torch/autograd.h>
#include <torch/cuda.h>
#include <torch/custom_class.h>
#include <torch/torch.h>

#include <algorithm>
#include <mutex>

#include "parallel/shape_text.h"
#include "parallel/replica_threads.h"
#include "shoal/error.h"

namespace shoal::parallel {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

// What the wrapper shares with the autograd nodes it creates: the threads (a backward runs the
// replicas' backwards on them) and the stats. A graph kept after the wrapper is gone still works.
struct DataParallelBase::Shared {
  Shared(int slots, int intra_op_threads) : threads(slots, intra_op_threads) {}
  ReplicaThreads threads;
  std::mutex stats_mutex;
  DataParallelStats stats;
  std::vector<std::string> device_names;
  std::chrono::milliseconds timeout{0};

  void add(double DataParallelStats::*field, double seconds) {
    std::lock_guard<std::mutex> lock(stats_mutex);
    stats.*field += seconds;
  }

  // Runs job(r) for r < n; rethrows the first failure as shoal::Error naming the replica.
  void run(int n, std::shared_ptr<const std::function<void(int)>> job, const char* phase,
           std::vector<double> DataParallelStats::*per_replica) {
    std::vector<ReplicaThreads::Outcome> outcomes = threads.run(n, std::move(job), timeout);
    {
      std::lock_guard<std::mutex> lock(stats_mutex);
      auto& seconds = stats.*per_replica;
      if (seconds.size() < outcomes.size()) seconds.resize(outcomes.size(), 0.0);
      for (size_t r = 0; r < outcomes.size(); ++r) seconds[r] += outcomes[r].seconds;
    }
    for (size_t r = 0; r < outcomes.size(); ++r) {
      if (!outcomes[r].error) continue;
      SHOAL_THROW(Error, "DataParallel: replica ", r, " (", device_names[r], ") failed in ",
                  phase, ": ", ReplicaThreads::message_of(outcomes[r].error));
    }
  }
};

// Per replica (1..K-1): what its parameters and buffers were last refreshed from.
struct DataParallelBase::ReplicaState {
  std::vector<at::Tensor> parameters;  // the replica's, aligned with the module's
  std::vector<at::Tensor> buffers;
  std::vector<const void*> parameter_source;  // module parameter data it shares / was copied from
  std::vector<int64_t> parameter_version;     // module parameter version at the last copy
};

namespace {

// The wrapper's threads and stats, kept by each gather node (apart from StepGraphs, so that the
// replica jobs, which hold StepGraphs, never hold the threads they run on).
struct SharedRef : torch::CustomClassHolder {
  std::shared_ptr<DataParallelBase::Shared> shared;
};

// One step's replica graphs, kept by the gather node until its backward.
struct StepGraphs : torch::CustomClassHolder {
  int replicas = 0;
  std::vector<int64_t> dims;        // [slot] the dim the slot was gathered along
  std::vector<int64_t> input_dims;  // [input] the dim a scattered input was split along
  // Per gathered slot: replica r's output (with its graph), its offset and length along dim
  // (length -1: a 0-dim output stacked at index r).
  std::vector<std::vector<at::Tensor>> outputs;  // [replica][slot]
  std::vector<std::vector<int64_t>> offsets;     // [replica][slot]
  std::vector<std::vector<int64_t>> lengths;     // [replica][slot]
  // Per replica, the leaves standing for the node's inputs (replica parameters, input chunks),
  // and the input each leaf stands for: a parameter registered under several names (tied
  // weights) is one input, and a replica whose copy of it is untied has several leaves for it,
  // whose gradients are summed (PyTorch's DataParallel, like DDP, de-duplicates by identity).
  std::vector<std::vector<at::Tensor>> leaves;     // [replica][leaf]
  std::vector<std::vector<size_t>> leaf_inputs;    // [replica][leaf] -> input
  std::vector<at::Device> input_devices;           // [input] where its gradient goes
  size_t parameter_inputs = 0;                     // the first inputs are parameters (summed)
  std::vector<at::Device> devices;
  std::vector<at::Tensor> gathered;  // forward's results
};

// The autograd node joining the replicas' graphs to the module's parameters (see the header).
struct GatherFunction : torch::autograd::Function<GatherFunction> {
  // `inputs` only connect the node to the parameters and scattered inputs (as a TensorList:
  // LibTorch counts the elements of a TensorList as the node's inputs, not of a std::vector).
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs,
                                                c10::intrusive_ptr<StepGraphs> graphs,
                                                c10::intrusive_ptr<SharedRef> shared) {
    ctx->saved_data["graphs"] = at::IValue::make_capsule(graphs);
    ctx->saved_data["shared"] = at::IValue::make_capsule(shared);
    return graphs->gathered;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto graphs = c10::static_intrusive_pointer_cast<StepGraphs>(
        ctx->saved_data["graphs"].toCapsule());
    ctx->saved_data.erase("graphs");
    const std::shared_ptr<DataParallelBase::Shared> shared =
        c10::static_intrusive_pointer_cast<SharedRef>(ctx->saved_data["shared"].toCapsule())->shared;
    SHOAL_CHECK(graphs->replicas > 0,
                "DataParallel: backward ran twice through one forward's outputs; the replicas' "
                "graphs are freed by the first (retain_graph is not supported here)");
    auto start = Clock::now();
    const int n = graphs->replicas;
    const size_t inputs = graphs->input_devices.size();
    auto results = std::make_shared<std::vector<torch::autograd::variable_list>>(n);
    auto job = std::make_shared<const std::function<void(int)>>(
        [graphs, grad_outputs, results](int r) {
          std::vector<at::Tensor> outs;
          std::vector<at::Tensor> grads;
          for (size_t j = 0; j < graphs->outputs[r].size(); ++j) {
            const at::Tensor& out = graphs->outputs[r][j];
            if (!out.defined() || !out.requires_grad() || !grad_outputs[j].defined()) continue;
            at::Tensor grad = graphs->lengths[r][j] < 0
                                  ? grad_outputs[j].select(0, graphs->offsets[r][j])
                                  : grad_outputs[j].narrow(graphs->dims[j], graphs->offsets[r][j],
                                                           graphs->lengths[r][j]);
            outs.push_back(out);
            grads.push_back(grad.to(out.device()));
          }
          std::vector<at::Tensor> wanted;
          std::vector<size_t> where;
          for (size_t i = 0; i < graphs->leaves[r].size(); ++i) {
            const at::Tensor& leaf = graphs->leaves[r][i];
            if (leaf.defined() && leaf.requires_grad()) {
              wanted.push_back(leaf);
              where.push_back(i);
            }
          }
          torch::autograd::variable_list mine(graphs->leaves[r].size());
          if (!outs.empty() && !wanted.empty()) {
            auto got = torch::autograd::grad(outs, wanted, grads, /*retain_graph=*/false,
                                             /*create_graph=*/false, /*allow_unused=*/true);
            for (size_t k = 0; k < got.size(); ++k) mine[where[k]] = got[k];
          }
          (*results)[r] = std::move(mine);
        });
    shared->run(n, std::move(job), "backward", &DataParallelStats::replica_backward_seconds);
    shared->add(&DataParallelStats::backward_seconds, seconds_since(start));
    start = Clock::now();

    // Parameters: the replicas' gradients summed in replica order (and, within a replica, over the
    // leaves of a tied parameter) on the parameter's device. Inputs: the chunks' gradients
    // concatenated back along dim.
    torch::autograd::variable_list grads(inputs + 2);  // none for the two holders
    std::vector<std::vector<std::vector<size_t>>> leaves_of(
        n, std::vector<std::vector<size_t>>(inputs));  // [replica][input] -> leaves
    for (int r = 0; r < n; ++r) {
      for (size_t k = 0; k < graphs->leaf_inputs[r].size(); ++k) {
        leaves_of[r][graphs->leaf_inputs[r][k]].push_back(k);
      }
    }
    for (size_t i = 0; i < inputs; ++i) {
      const at::Device home = graphs->input_devices[i];
      if (i < graphs->parameter_inputs) {
        at::Tensor sum;
        for (int r = 0; r < n; ++r) {
          for (size_t k : leaves_of[r][i]) {
            const at::Tensor& g = (*results)[r][k];
            if (!g.defined()) continue;
            if (!sum.defined()) {
              sum = g.to(home);
            } else {
              sum.add_(g.to(home));
            }
          }
        }
        grads[i] = sum;
      } else {
        std::vector<at::Tensor> pieces;
        bool any = false;
        for (int r = 0; r < n; ++r) {
          const size_t k = leaves_of[r][i].at(0);
          const at::Tensor& g = (*results)[r][k];
          any = any || g.defined();
          pieces.push_back(g.defined() ? g.to(home) : at::zeros_like(graphs->leaves[r][k], home));
        }
        if (any) grads[i] = at::cat(pieces, graphs->input_dims[i]);
      }
    }
    // Free the replicas' graphs and mark the node used.
    graphs->outputs.clear();
    graphs->leaves.clear();
    graphs->replicas = 0;
    shared->add(&DataParallelStats::reduce_seconds, seconds_since(start));
    {
      std::lock_guard<std::mutex> lock(shared->stats_mutex);
      ++shared->stats.backward_steps;
    }
    return grads;
  }
};

}  // namespace

DataParallelBase::DataParallelBase(std::shared_ptr<torch::nn::Module> module,
                                   DataParallelOptions options, ReplicaFactory factory)
    : module_(std::move(module)),
      options_(std::move(options)),
      factory_(std::move(factory)),
      output_device_(at::kCPU) {
  SHOAL_CHECK_T(InvalidArgument, module_ != nullptr, "DataParallel: no module given");
  const bool cuda = options_.cuda().value_or(torch::cuda::is_available());
  std::vector<int64_t> ids = options_.device_ids();
  if (ids.empty()) {
    const int64_t count = cuda ? static_cast<int64_t>(torch::cuda::device_count()) : 1;
    for (int64_t i = 0; i < count; ++i) ids.push_back(i);
  }
  SHOAL_CHECK_T(InvalidArgument, !ids.empty(), "DataParallel: cuda requested but no GPU is visible");
  std::vector<std::string> names;
  for (size_t r = 0; r < ids.size(); ++r) {
    for (size_t q = 0; q < r; ++q) {
      SHOAL_CHECK_T(InvalidArgument, ids[q] != ids[r], "DataParallel: device id ", ids[r],
                    " given twice in device_ids");
    }
    if (cuda) {
      devices_.emplace_back(at::kCUDA, static_cast<c10::DeviceIndex>(ids[r]));
      names.push_back("cuda:" + std::to_string(ids[r]));
    } else {
      devices_.emplace_back(at::kCPU);
      names.push_back("cpu slot " + std::to_string(ids[r]));
    }
  }
  if (cuda) {
    const int64_t out = options_.output_device() < 0 ? ids[0] : options_.output_device();
    output_device_ = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(out));
  }
  for (const auto& p : module_->parameters()) {
    SHOAL_CHECK_T(InvalidArgument, p.device() == devices_[0], "DataParallel: the module's parameters must be on device_ids[0] (",
                  names[0], "), found one on ", p.device().str());
  }
  shared_ = std::make_shared<Shared>(static_cast<int>(devices_.size()),
                                     cuda ? 0 : options_.intra_op_threads());
  shared_->device_names = names;
  shared_->timeout = options_.timeout();
  make_replicas();
}

DataParallelBase::~DataParallelBase() = default;

std::string DataParallelBase::device_name(int replica) const {
  return shared_->device_names.at(replica);
}

void DataParallelBase::make_replicas() {
  replicas_.push_back(module_);
  replica_states_.push_back(nullptr);
  const auto params = module_->named_parameters();
  const auto buffers = module_->named_buffers();
  for (int r = 1; r < replica_count(); ++r) {
    std::shared_ptr<torch::nn::Module> replica;
    if (factory_) {
      replica = factory_();
    } else {
      try {
        replica = module_->clone();
      } catch (const c10::Error& e) {
        SHOAL_THROW(InvalidArgument, "DataParallel: cannot clone ", module_->name(),
                    " for replica ", r, " (derive it from torch::nn::Cloneable, or pass a replica "
                    "factory): ", e.what_without_backtrace());
      }
    }
    SHOAL_CHECK_T(InvalidArgument, replica != nullptr, "DataParallel: the replica factory returned null");
    replica->to(devices_[r]);
    auto state = std::make_unique<ReplicaState>();
    const auto replica_params = replica->named_parameters();
    const auto replica_buffers = replica->named_buffers();
    SHOAL_CHECK_T(InvalidArgument,
                  replica_params.size() == params.size() && replica_buffers.size() == buffers.size(),
                  "DataParallel: replica ", r, " has ", replica_params.size(), " parameters and ",
                  replica_buffers.size(), " buffers; the module has ", params.size(), " and ",
                  buffers.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& mine = replica_params[i];
      SHOAL_CHECK_T(InvalidArgument,
                    mine.key() == params[i].key() && mine.value().sizes() == params[i].value().sizes(),
                    "DataParallel: replica ", r, " parameter ", i, " is ", mine.key(), " ",
                    shape_of(mine.value()), "; the module's is ", params[i].key(), " ",
                    shape_of(params[i].value()));
      state->parameters.push_back(mine.value());
    }
    for (size_t i = 0; i < buffers.size(); ++i) {
      SHOAL_CHECK_T(InvalidArgument, replica_buffers[i].key() == buffers[i].key(),
                    "DataParallel: replica ", r, " buffer ", i, " is ", replica_buffers[i].key(),
                    "; the module's is ", buffers[i].key());
      state->buffers.push_back(replica_buffers[i].value());
    }
    state->parameter_source.assign(params.size(), nullptr);
    state->parameter_version.assign(params.size(), -1);
    replicas_.push_back(std::move(replica));
    replica_states_.push_back(std::move(state));
  }
}

void DataParallelBase::replicate(int n) {
  if (n <= 1) return;
  const std::vector<at::Tensor> params = module_->parameters();
  const std::vector<at::Tensor> buffers = module_->buffers();
  at::NoGradGuard no_grad;
  for (int r = 1; r < n; ++r) {
    ReplicaState& state = *replica_states_[r];
    SHOAL_CHECK(params.size() == state.parameters.size() && buffers.size() == state.buffers.size(),
                "DataParallel: the module now has ", params.size(), " parameters and ",
                buffers.size(), " buffers, its replicas ", state.parameters.size(), " and ",
                state.buffers.size(), "; parameters cannot be added after wrapping");
    if (replicas_[r]->is_training() != module_->is_training()) {
      replicas_[r]->train(module_->is_training());
    }
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& source = params[i];
      at::Tensor& mine = state.parameters[i];
      if (source.device() == mine.device()) {
        // Share the module's storage: nothing to copy, now or after any optimizer step.
        if (state.parameter_source[i] != source.unsafeGetTensorImpl()->storage().data() ||
            mine.sizes() != source.sizes() || mine.strides() != source.strides() ||
            mine.storage_offset() != source.storage_offset() ||
            mine.scalar_type() != source.scalar_type()) {
          mine.set_data(source.detach());
          state.parameter_source[i] = source.unsafeGetTensorImpl()->storage().data();
        }
      } else if (state.parameter_version[i] != source._version() ||
                 state.parameter_source[i] != source.data_ptr()) {
        if (mine.sizes() != source.sizes() || mine.scalar_type() != source.scalar_type()) {
          mine.set_data(source.detach().to(mine.device(), /*non_blocking=*/false, /*copy=*/true));
        } else {
          mine.copy_(source, /*non_blocking=*/true);
        }
        state.parameter_version[i] = source._version();
        state.parameter_source[i] = source.data_ptr();
      }
      if (mine.requires_grad() != source.requires_grad()) mine.requires_grad_(source.requires_grad());
    }
    for (size_t i = 0; i < buffers.size(); ++i) {
      const at::Tensor& source = buffers[i];
      at::Tensor& mine = state.buffers[i];
      if (!source.defined() || !mine.defined()) continue;
      // Every forward, as PyTorch's broadcast of buffers: BatchNorm's kernels update running
      // statistics without moving the version counter, so versions cannot tell what changed
      // (and buffers are small).
      if (mine.sizes() != source.sizes() || mine.scalar_type() != source.scalar_type()) {
        mine.set_data(source.detach().to(mine.device(), /*non_blocking=*/false, /*copy=*/true));
      } else {
        mine.copy_(source, /*non_blocking=*/true);
      }
    }
  }
}

void DataParallelBase::count_chunks(const at::Tensor& tensor, ScatterState& state) const {
  if (!tensor.defined()) {  // keeps the indices aligned with scatter_tensor's
    state.chunk_counts.push_back({-1, -1, -1});
    return;
  }
  SHOAL_CHECK_T(InvalidArgument, tensor.dim() > 0,
                "DataParallel: cannot scatter a 0-dim tensor input along dim ", options_.dim());
  const int64_t dim = c10::maybe_wrap_dim(options_.dim(), tensor.dim());
  const int64_t size = tensor.size(dim);
  SHOAL_CHECK_T(InvalidArgument, size > 0, "DataParallel: an input has size 0 along dim ", dim,
                " (", shape_of(tensor), "): nothing to scatter");
  const int64_t k = replica_count();
  const int64_t chunk = (size + k - 1) / k;
  state.chunk_counts.push_back({(size + chunk - 1) / chunk, size, chunk});
}

void DataParallelBase::settle_replicas(ScatterState& state) const {
  const std::vector<int64_t>* first = nullptr;
  for (const auto& c : state.chunk_counts) {
    if (c[0] < 0) continue;
    if (first == nullptr) first = &c;
    SHOAL_CHECK_T(InvalidArgument, c[1] == (*first)[1],
                  "DataParallel: inputs differ in size along dim ", options_.dim(), " (", c[1],
                  " and ", (*first)[1], "); every tensor input is split into the same chunks");
  }
  state.replicas = first == nullptr ? replica_count() : static_cast<int>((*first)[0]);
  state.leaves.assign(state.replicas, {});
}

at::Tensor DataParallelBase::scatter_tensor(const at::Tensor& tensor, int replica,
                                            size_t tensor_index, ScatterState& state) {
  if (!tensor.defined()) return tensor;
  const int64_t dim = c10::maybe_wrap_dim(options_.dim(), tensor.dim());
  const int64_t size = tensor.size(dim);
  const int64_t chunk = state.chunk_counts.at(tensor_index)[2];
  const int64_t offset = replica * chunk;
  const int64_t length = std::min(chunk, size - offset);
  const bool track = at::GradMode::is_enabled() && tensor.requires_grad();
  at::Tensor piece = (track ? tensor.detach() : tensor).narrow(dim, offset, length);
  if (piece.device() != devices_[replica]) piece = piece.to(devices_[replica], /*non_blocking=*/true);
  if (track) {
    piece = piece.detach().requires_grad_(true);
    if (state.sources.size() <= tensor_index) state.sources.resize(tensor_index + 1);
    state.sources[tensor_index] = tensor;
    auto& leaves = state.leaves[replica];
    if (leaves.size() <= tensor_index) leaves.resize(tensor_index + 1);
    leaves[tensor_index] = piece;
  }
  return piece;
}

void DataParallelBase::run_replicas(int n, std::shared_ptr<const std::function<void(int)>> job) {
  shared_->run(n, std::move(job), "forward", &DataParallelStats::replica_forward_seconds);
  std::lock_guard<std::mutex> lock(shared_->stats_mutex);
  ++shared_->stats.steps;
}

namespace {

// Gathers slot j of every replica's outputs onto `device` into `result` (concatenated along
// `dim`, or stacked when 0-dim), recording each replica's offset and length in `graphs`; returns
// true when autograd must route the slot through the gather node (then its replicas' outputs
// and its dim are kept in `graphs`).
bool gather_slot(const std::vector<std::vector<at::Tensor>>& outputs, size_t j, int64_t dim,
                 const at::Device& device, bool grad_mode, StepGraphs& graphs, at::Tensor& result) {
  const int n = static_cast<int>(outputs.size());
  bool defined = true;
  bool tracked = false;
  for (int r = 0; r < n; ++r) {
    defined = defined && outputs[r][j].defined();
    if (defined) tracked = tracked || outputs[r][j].requires_grad();
  }
  if (!defined) {
    SHOAL_CHECK(!outputs[0][j].defined(), "DataParallel: output tensor ", j,
                " is undefined on some replicas only");
    return false;
  }
  const bool scalar = outputs[0][j].dim() == 0;
  std::vector<at::Tensor> pieces;
  int64_t offset = 0, slot_dim = 0;
  for (int r = 0; r < n; ++r) {
    const at::Tensor& out = outputs[r][j];
    SHOAL_CHECK(scalar == (out.dim() == 0), "DataParallel: output tensor ", j, " is 0-dim on some replicas only");
    at::Tensor piece = tracked ? out.detach() : out;
    if (piece.device() != device) piece = piece.to(device);
    pieces.push_back(piece);
    if (scalar) {
      graphs.offsets[r][j] = r;
      graphs.lengths[r][j] = -1;
    } else {
      slot_dim = c10::maybe_wrap_dim(dim, out.dim());
      graphs.offsets[r][j] = offset;
      graphs.lengths[r][j] = out.size(slot_dim);
      offset += out.size(slot_dim);
    }
  }
  result = scalar ? at::stack(pieces, 0) : at::cat(pieces, dim);
  if (!grad_mode || !tracked) return false;
  for (int r = 0; r < n; ++r) graphs.outputs[r][j] = outputs[r][j];
  graphs.dims.push_back(slot_dim);
  return true;
}

// The module's parameters that require grad as the node's first inputs; per replica
// (replica_params[r], aligned with `params`), the leaves that stand for them. LibTorch lists a
// parameter registered under two names twice: it is one input (fed once), and each replica's
// leaves for it are its distinct copies (one when the replica keeps the tie).
void add_parameter_inputs(const std::vector<at::Tensor>& params,
                          const std::vector<const std::vector<at::Tensor>*>& replica_params,
                          StepGraphs& graphs, std::vector<at::Tensor>& inputs) {
  const int n = graphs.replicas;
  std::vector<const c10::TensorImpl*> seen_inputs;
  std::vector<std::vector<const c10::TensorImpl*>> seen_leaves(n);
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].requires_grad()) continue;
    const c10::TensorImpl* impl = params[i].unsafeGetTensorImpl();
    size_t input = std::find(seen_inputs.begin(), seen_inputs.end(), impl) - seen_inputs.begin();
    if (input == seen_inputs.size()) {
      seen_inputs.push_back(impl);
      inputs.push_back(params[i]);
      graphs.input_dims.push_back(0);
      graphs.input_devices.push_back(params[i].device());
    }
    for (int r = 0; r < n; ++r) {
      const at::Tensor& leaf = (*replica_params[r])[i];
      auto& seen = seen_leaves[r];
      if (std::find(seen.begin(), seen.end(), leaf.unsafeGetTensorImpl()) != seen.end()) continue;
      seen.push_back(leaf.unsafeGetTensorImpl());
      graphs.leaves[r].push_back(leaf);
      graphs.leaf_inputs[r].push_back(input);
    }
  }
  graphs.parameter_inputs = inputs.size();
}

// The scattered inputs that require grad as the node's next inputs, each replica's chunk leaf
// (leaves[r][s]) standing for source s.
void add_scattered_inputs(const std::vector<at::Tensor>& sources,
                          const std::vector<std::vector<at::Tensor>>& leaves, int64_t dim,
                          StepGraphs& graphs, std::vector<at::Tensor>& inputs) {
  for (size_t s = 0; s < sources.size(); ++s) {
    if (!sources[s].defined()) continue;
    inputs.push_back(sources[s]);
    graphs.input_dims.push_back(c10::maybe_wrap_dim(dim, sources[s].dim()));
    graphs.input_devices.push_back(sources[s].device());
    for (int r = 0; r < graphs.replicas; ++r) {
      graphs.leaves[r].push_back(leaves[r].at(s));
      graphs.leaf_inputs[r].push_back(inputs.size() - 1);
    }
  }
}

// Keeps only the differentiable slots in the per-slot tables: they are the node's outputs (the
// others keep their gathered values).
void keep_slots(const std::vector<size_t>& differentiable, StepGraphs& graphs) {
  const int n = graphs.replicas;
  std::vector<std::vector<at::Tensor>> kept(n);
  std::vector<std::vector<int64_t>> offsets(n), lengths(n);
  for (int r = 0; r < n; ++r) {
    for (size_t j : differentiable) {
      kept[r].push_back(graphs.outputs[r][j]);
      offsets[r].push_back(graphs.offsets[r][j]);
      lengths[r].push_back(graphs.lengths[r][j]);
    }
  }
  graphs.outputs = std::move(kept);
  graphs.offsets = std::move(offsets);
  graphs.lengths = std::move(lengths);
}

}  // namespace

std::vector<at::Tensor> DataParallelBase::gather(
    const std::vector<std::vector<at::Tensor>>& outputs, ScatterState& scatter) {
  const int n = static_cast<int>(outputs.size());
  const size_t slots = outputs[0].size();
  for (int r = 1; r < n; ++r) {
    SHOAL_CHECK(outputs[r].size() == slots, "DataParallel: replica ", r, " returned ",
                outputs[r].size(), " tensors, replica 0 returned ", slots);
  }
  auto graphs = c10::make_intrusive<StepGraphs>();
  graphs->replicas = n;
  graphs->outputs.assign(n, std::vector<at::Tensor>(slots));
  graphs->offsets.assign(n, std::vector<int64_t>(slots, 0));
  graphs->lengths.assign(n, std::vector<int64_t>(slots, 0));
  graphs->devices = devices_;
  const bool grad_mode = at::GradMode::is_enabled();
  std::vector<at::Tensor> result(slots);
  std::vector<size_t> differentiable;  // slots routed through the gather node
  for (size_t j = 0; j < slots; ++j) {
    if (gather_slot(outputs, j, options_.dim(), output_device_, grad_mode, *graphs, result[j])) {
      differentiable.push_back(j);
    }
  }
  if (differentiable.empty()) return result;
  // The node's inputs: the module's parameters that require grad, then the scattered inputs that
  // do; per replica, the leaves that stand for them.
  std::vector<at::Tensor> inputs;
  graphs->leaves.assign(n, {});
  graphs->leaf_inputs.assign(n, {});
  const std::vector<at::Tensor> params = module_->parameters();
  std::vector<const std::vector<at::Tensor>*> replica_params(n, &params);
  for (int r = 1; r < n; ++r) replica_params[r] = &replica_states_[r]->parameters;
  add_parameter_inputs(params, replica_params, *graphs, inputs);
  add_scattered_inputs(scatter.sources, scatter.leaves, options_.dim(), *graphs, inputs);
  if (inputs.empty()) return result;  // nothing to differentiate with respect to
  auto holder = c10::make_intrusive<SharedRef>();
  holder->shared = shared_;
  for (size_t j : differentiable) graphs->gathered.push_back(result[j]);
  keep_slots(differentiable, *graphs);
  torch::autograd::variable_list tied = GatherFunction::apply(at::TensorList(inputs), graphs, holder);
  for (size_t k = 0; k < differentiable.size(); ++k) result[differentiable[k]] = tied[k];
  return result;
}

void DataParallelBase::add_phase(double DataParallelStats::*field, double seconds) {
  shared_->add(field, seconds);
}

torch::OrderedDict<std::string, at::Tensor> DataParallelBase::named_parameters() const {
  return module_->named_parameters();
}

torch::OrderedDict<std::string, at::Tensor> DataParallelBase::named_buffers() const {
  return module_->named_buffers();
}

std::vector<at::Tensor> DataParallelBase::parameters() const { return module_->parameters(); }

DataParallelStats DataParallelBase::stats() const {
  std::lock_guard<std::mutex> lock(shared_->stats_mutex);
  return shared_->stats;
}

void DataParallelBase::reset_stats() {
  std::lock_guard<std::mutex> lock(shared_->stats_mutex);
  shared_->stats = DataParallelStats{};
}

}  // namespace shoal::parallel
