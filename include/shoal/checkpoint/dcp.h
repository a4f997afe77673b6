// PyTorch's distributed checkpoint (DCP) format, written and read: a folder holding `.metadata` (a pickle
// of torch.distributed.checkpoint.metadata.Metadata: each tensor's dtype, size and chunks, and
// where each chunk's bytes are) and `__0_0.distcp` (each tensor torch.save'd, one after the
// other), as `torch.distributed.checkpoint.save` writes it from one process. So
// `torch.distributed.checkpoint.load(model.state_dict(), checkpoint_id=folder)` fills a PyTorch
// model, plain or FSDP2-sharded on any number of ranks (DCP reshards on load), from a Shoal model.
// load_dcp reads what save_dcp or PyTorch 2.x's dcp.save wrote (from any number of ranks, each
// tensor assembled whole from its chunks); `.metadata` is read as plain data by the hardened
// unpickler (its Python classes accepted by name, nothing called) and every offset and size in it
// is checked against the tensors and the data files before anything is allocated.
//
// Thread safety: a plain function.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "shoal/checkpoint/serialization.h"
#include "shoal/checkpoint/state_dict.h"

namespace shoal::checkpoint {

/// Writes `state` (its keys as the fully qualified names DCP loads by) as a DCP checkpoint into
/// `folder`, which must not exist or be empty. The data file is written first and `.metadata`
/// last, each atomically: a folder cut short by a crash has no `.metadata` and DCP refuses it.
/// Throws CheckpointError naming the folder.
void save_dcp(const StateDict& state, const std::string& folder);

/// What load_dcp read.
struct DcpContents {
  /// Every tensor entry, assembled whole, in the order of `.metadata`.
  StateDict tensors;
  /// The entries that are not tensors (DCP's bytes entries: pickled Python objects such as an
  /// optimizer's param_groups), left out: Shoal does not unpickle arbitrary objects.
  std::vector<std::string> skipped;
};

/// Reads the DCP checkpoint in `folder`. Throws CheckpointError naming the file when `.metadata`
/// names a class other than DCP's own, a chunk lies outside its tensor, chunks overlap or leave
/// part of a tensor unwritten, a chunk's bytes lie beyond its data file, or a chunk's dtype or
/// size differs from what `.metadata` says. `options` bound the `.metadata` pickle and each chunk's
/// archive as they bound load().
DcpContents load_dcp(const std::string& folder, const LoadOptions& options = {});

/// The object of the bytes entry `name` (e.g. Shoal's own "shoal" entry of a sharded checkpoint),
/// read by the hardened unpickler as plain data, or nullopt when `.metadata` lists no such entry.
/// Throws CheckpointError as load_dcp does, and when the object is not plain data.
std::optional<c10::IValue> load_dcp_object(const std::string& folder, const std::string& name,
                                           const LoadOptions& options = {});

/// The tensor entry `fqn` alone, assembled from its chunks, or nullopt when `.metadata` lists no
/// such tensor. Throws CheckpointError as load_dcp does for that entry's chunks.
std::optional<at::Tensor> load_dcp_tensor(const std::string& folder, const std::string& fqn,
                                          const LoadOptions& options = {});

/// Every bytes entry whose name starts with `prefix`, by name, read as load_dcp_object reads one
/// (`.metadata` parsed once).
std::map<std::string, c10::IValue> load_dcp_objects(const std::string& folder, const std::string& prefix,
                                                    const LoadOptions& options = {});

/// True when `folder` holds a `.metadata` file: a DCP checkpoint.
bool is_dcp_folder(const std::string& folder);

}  // namespace shoal::checkpoint
