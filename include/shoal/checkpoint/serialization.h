// Reading and writing files in PyTorch's own format (the zip archive of torch.save), so that
// Python's torch.load reads what Shoal saves and Shoal reads what Python saves.
//
// Writing is atomic: a file is written under a temporary name in the same folder, fsync'ed,
// renamed over the target and the folder fsync'ed, so a crash leaves either the old file or the
// new one, never a mix. Each file carries a record "shoal_checksum" (CRC32 of every other record),
// which torch.load ignores and Shoal checks when reading: a record the manifest leaves out, or a
// file that says Shoal wrote it (a 'shoal_version' entry) without a manifest, is refused as edited
// or damaged; files from Python (no manifest) load unchecked, as torch.load does. Reading never runs code from the file:
// only tensors, containers and plain values are accepted (see checkpoint/unpickler.h).
// Every failure throws CheckpointError naming the file and what is wrong.
//
// Thread safety: functions are reentrant; do not write one path from two threads at once.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

#include <string>

#include "shoal/checkpoint/state_dict.h"
#include "shoal/checkpoint/training_state.h"

namespace shoal::checkpoint {

struct LoadOptions {
  /// Where loaded tensors go. CPU by default: a file saved on a GPU never lands on the first GPU
  /// unless asked for.
  c10::Device map_location = c10::Device(c10::kCPU);
  /// Most values the loaded object may hold, counting a container shared by several others once
  /// per reference (what printing or re-saving it writes out). 2^22 by default: a state dict holds
  /// about two per tensor. A file beyond it is refused (a few KB of shared lists can stand for
  /// 2^40 values); raise it for a genuine checkpoint that holds more.
  uint64_t max_values = uint64_t{1} << 22;
  /// Most memory the loaded object's containers (dicts, lists, tuples) may take, each counted once
  /// by an estimate of what it costs (see UnpicklerLimits). 256 MiB by default: an optimizer state
  /// of 100,000 parameters takes about 60 MiB, while a 4 KB file of 4 million empty dicts would
  /// take 1.5 GB. Raise it for a genuine checkpoint that holds more.
  uint64_t max_container_bytes = uint64_t{256} << 20;
  /// Accept tensors whose view holds more elements than their storage (torch.zeros(1).expand(n)
  /// saved as is, stride 0). Refused by default: copying such a tensor out writes as many bytes as
  /// its view claims, however small the file.
  bool allow_expanded_views = false;
};

/// torch.save(object, path): dicts, lists, tuples, tensors, ints, floats, strings, bools, None.
/// A Dict<string, Tensor> is written as collections.OrderedDict (a state dict).
void save(const c10::IValue& object, const std::string& path);

/// torch.load(path) restricted to tensors, containers and plain values. Dicts (also OrderedDicts)
/// come back as generic dicts in file order.
c10::IValue load(const std::string& path, const LoadOptions& options = {});

/// Saves a state dict as Python's model.state_dict() would be saved.
void save_state_dict(const StateDict& state, const std::string& path);

/// Loads a state dict from a file holding one, or the model of a full checkpoint (or of a sharded
/// checkpoint, given its folder, or the tensors of a DCP checkpoint, see dcp.h: its non-tensor
/// entries are left out, with a note); a "module." prefix on every key is removed.
StateDict load_state_dict_file(const std::string& path, const LoadOptions& options = {});

/// Saves `state` as a dict Python can read (see to_ivalue()).
void save_training_state(const TrainingState& state, const std::string& path);

/// Loads a file written by save_training_state, or by Python (see training_state_from_ivalue()),
/// or, given a folder, the sharded checkpoint in it assembled whole (see sharded_checkpoint.h).
TrainingState load_training_state(const std::string& path, const LoadOptions& options = {});

/// A state dict from a loaded object (a bare state dict, or the 'model' of a checkpoint dict).
StateDict state_dict_from_ivalue(const c10::IValue& object, const std::string& where);

/// A Dict<string, Tensor> holding `state` (saved as an OrderedDict).
c10::IValue state_dict_to_ivalue(const StateDict& state);

}  // namespace shoal::checkpoint
