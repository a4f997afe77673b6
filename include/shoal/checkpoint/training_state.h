// TrainingState: everything needed to resume training — weights, optimizer state, epoch and step,
// the random number generator, where the sampler was, and the configuration that made it.
//
// The state never depends on the world size: the sampler position is the number of samples the
// whole job has consumed in the current epoch (summed over ranks), not a per-rank index, and the
// weights are saved without any wrapper prefix. Those samples are the first samples_seen of the
// epoch's global order (seed + epoch), whatever the world size, so a job resumed with another
// number of ranks deals the rest of that order over its ranks (train::sampler_indices), and every
// sample of the rest is trained once; the learning-rate schedule follows `step`.
//
// capture()/restore() move the state between a TrainingState and a live module + optimizer
// (torch::optim::SGD, Adam, AdamW); the optimizer state mirrors Python's optimizer.state_dict()
// (parameters numbered across groups in order), so files move between C++ and Python.
//
// Thread safety: plain values; capture/restore must not run while another thread trains.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "shoal/checkpoint/state_dict.h"

namespace shoal::checkpoint {

/// One entry of Python's optimizer.state_dict()['param_groups'].
struct ParamGroupState {
  std::vector<int64_t> params;                  ///< parameter indices, numbered across groups
  std::map<std::string, c10::IValue> options;   ///< "lr", "momentum", "betas", ... (Python names)
};

/// Python's optimizer.state_dict(): per-parameter buffers and per-group hyperparameters.
struct OptimizerState {
  /// By parameter index: "momentum_buffer" (SGD); "step", "exp_avg", "exp_avg_sq",
  /// "max_exp_avg_sq" (Adam/AdamW; "step" is a 0-dim float32 tensor, as in PyTorch 1.13).
  std::map<int64_t, std::map<std::string, at::Tensor>> state;
  std::vector<ParamGroupState> param_groups;
  bool empty() const { return state.empty() && param_groups.empty(); }
};

/// Where the data sampler was, independent of the world size.
struct SamplerState {
  int64_t epoch = 0;         ///< the epoch being trained (DistributedSampler::set_epoch)
  int64_t samples_seen = 0;  ///< samples the whole job consumed in that epoch, all ranks together
  int64_t seed = 0;          ///< the sampler's shuffle seed
};

/// How many samples of the resumed epoch each rank skips when a job resumes with `world_size`
/// ranks by skipping into its uninterrupted DistributedSampler shard (rank, rank + world_size,
/// ...): exact only when samples_seen is a multiple of world_size (otherwise up to
/// world_size - 1 samples are seen again). The trainer deals the rest of the order instead.
inline int64_t samples_to_skip_per_rank(const SamplerState& sampler, int64_t world_size) {
  return world_size > 0 ? sampler.samples_seen / world_size : 0;
}

struct TrainingState {
  StateDict model;                             ///< weights and buffers, no wrapper prefix
  OptimizerState optimizer;                    ///< empty when no optimizer was captured
  int64_t epoch = 0;                           ///< completed epochs
  int64_t step = 0;                            ///< optimizer steps taken so far (global)
  at::Tensor rng_state;                        ///< torch's default CPU generator (uint8), or undefined
  SamplerState sampler;
  /// The configuration that produced this state, as Python sees it in torch.load: numbers as
  /// int or float ("lr", "batch_size", ...), names as str ("model"). Checkpoints of Shoal 0.1
  /// before this stored every value as a string; they load with those strings (see
  /// config_number).
  std::map<std::string, c10::IValue> config;
  int64_t world_size = 1;                      ///< informational: the world size that saved it
  std::string shoal_version;                   ///< filled in when saved
};

/// The model's state dict, the optimizer's state (when given) and the RNG state; epoch, step,
/// sampler and config are left for the caller to fill in.
TrainingState capture(const torch::nn::Module& module, torch::optim::Optimizer* optimizer = nullptr);

/// The optimizer's state in Python's layout. Supports SGD, Adam and AdamW; throws InvalidArgument
/// for other optimizers.
OptimizerState capture_optimizer(torch::optim::Optimizer& optimizer);

struct RestoreOptions {
  bool strict = true;        ///< every key must match (see load_state_dict)
  bool restore_rng = true;   ///< also set torch's default CPU generator
};

/// Loads the weights into `module`, and the optimizer state (when given and present) into
/// `optimizer`, which must have been built over the same parameters in the same order.
void restore(const TrainingState& state, torch::nn::Module& module,
             torch::optim::Optimizer* optimizer = nullptr, const RestoreOptions& options = {});

/// Sets the optimizer's per-parameter state and hyperparameters from `state`. Throws
/// CheckpointError when the number of groups or parameters, or a buffer's shape, does not match.
void restore_optimizer(const OptimizerState& state, torch::optim::Optimizer& optimizer);

/// torch's default CPU generator state (torch.get_rng_state() in Python).
at::Tensor get_rng_state();
/// Sets torch's default CPU generator (torch.set_rng_state()).
void set_rng_state(const at::Tensor& state);

/// The Python-compatible object a TrainingState is saved as: {'model': OrderedDict, 'optimizer':
/// {'state', 'param_groups'}, 'epoch', 'step', 'rng_state', 'sampler', 'config', 'world_size',
/// 'shoal_version'}.
c10::IValue to_ivalue(const TrainingState& state);

/// Reads a loaded object: Shoal's layout, a Python dict with 'model'/'model_state_dict'/
/// 'state_dict' and 'optimizer'/'optimizer_state_dict', or a bare state dict. `where` names the
/// file in errors. A "module." prefix on the model's keys is removed.
TrainingState training_state_from_ivalue(const c10::IValue& object, const std::string& where);

/// The config value under `key` as a number: an int or float, or a string holding one (what older
/// checkpoints stored); nothing when `key` is absent. Throws CheckpointError naming `where` when the
/// value is not a finite number.
std::optional<double> config_number(const TrainingState& state, const std::string& key,
                                    const std::string& where);

/// Like config_number, for integers (epochs, seeds): exact beyond 2^53. Throws CheckpointError
/// when the value is not an integer.
std::optional<int64_t> config_integer(const TrainingState& state, const std::string& key,
                                      const std::string& where);

/// The config value under `key` as text (a string as it is, a number as its shortest exact
/// text), or `fallback` when absent.
std::string config_text(const TrainingState& state, const std::string& key,
                        const std::string& fallback = {});

/// Shoal's version ("0.1.0").
const char* version();

}  // namespace shoal::checkpoint
