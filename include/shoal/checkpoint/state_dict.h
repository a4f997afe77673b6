// State dicts: a module's parameters and buffers by name, as PyTorch's Module.state_dict().
//
// Keys and order follow PyTorch ("0.weight", "features.1.running_mean": each module's parameters,
// then its buffers, modules in pre-order), so a state dict taken here loads into the equivalent
// Python nn.Module and the other way round.
//
// Thread safety: none of these functions may run while another thread changes the module.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/ordered_dict.h>

#include <string>
#include <vector>

namespace shoal::checkpoint {

/// Name → tensor, in insertion order.
using StateDict = torch::OrderedDict<std::string, at::Tensor>;

/// The module's parameters and buffers (detached, sharing memory with the module), PyTorch's
/// names and order. A wrapper prefix ("module.", as DataParallel/DDP add) is removed when every
/// key carries it, so that checkpoints never depend on how the model was wrapped.
StateDict state_dict(const torch::nn::Module& module);

/// What load_state_dict found (PyTorch's _IncompatibleKeys).
struct LoadStateDictResult {
  std::vector<std::string> missing_keys;     ///< in the module, not in the state dict
  std::vector<std::string> unexpected_keys;  ///< in the state dict, not in the module
  std::vector<std::string> cast_keys;        ///< copied to the module's floating-point width
  bool ok() const { return missing_keys.empty() && unexpected_keys.empty(); }
};

/// Copies `state` into the module's parameters and buffers (converting device, and the width of a
/// floating-point or integer dtype). A "module." prefix on every key of `state` is accepted and
/// removed. With `strict`, any missing or unexpected key throws CheckpointError listing them all; a
/// shape mismatch always throws (as in PyTorch), and so does a change of dtype kind (see
/// check_dtype_change); width changes are copied as PyTorch's copy_ does and named in one warning
/// (and in cast_keys). Nothing is copied when anything throws. Returns the keys that did not match
/// (empty lists when strict).
LoadStateDictResult load_state_dict(torch::nn::Module& module, const StateDict& state,
                                    bool strict = true);

/// PyTorch's Python name of a dtype ("float32", "int8", "complex64").
std::string dtype_name(c10::ScalarType type);

/// Whether a tensor of dtype `from` (the checkpoint's) may be copied into one of dtype `to` (the
/// model's): false when they are equal, true when only the width changes (float64 -> float32,
/// int32 -> int64: copied, and the caller names it). A change of kind (complex to real, integer or
/// bool to floating point or back) throws CheckpointError naming `name`: PyTorch's copy_ would
/// cast silently (dropping imaginary parts, turning flags into weights), which is never what a
/// checkpoint of the same model holds.
bool check_dtype_change(c10::ScalarType from, c10::ScalarType to, const std::string& name);

/// Keys that start with `prefix` lose it; the others are kept as they are.
StateDict strip_prefix(const StateDict& state, const std::string& prefix);

/// Every key gets `prefix` in front.
StateDict add_prefix(const StateDict& state, const std::string& prefix);

/// True when `state` is not empty and every key starts with `prefix`.
bool all_keys_have_prefix(const StateDict& state, const std::string& prefix);

/// The prefix DataParallel and DistributedDataParallel put in front of every key.
inline const char* const kWrapperPrefix = "module.";

}  // namespace shoal::checkpoint
