// Checks a TorchScript archive (torch.jit.save) before LibTorch's loader (torch::jit::load) reads
// it, with the rules Shoal's own checkpoint reader applies: every record judged by what the zip
// directory declares before anything is inflated, and data.pkl and constants.pkl read by Shoal's
// restricted unpickler, so that each tensor is known to lie within its storage and each storage
// within its record. torch::jit::load checks neither: a 1 MB file could inflate a weight record
// to a gigabyte, and a parameter could claim 2^40 elements over a storage of four.
//
// Storages are never read: their sizes come from the zip directory and the tensors are built on
// the meta device, so the check costs the pickles' size, not the model's.
//
// Thread safety: a free function with no shared state.
#pragma once

#include <string>

namespace shoal::checkpoint::detail {

/// Throws CheckpointError naming `path` and what is wrong when the file is not a well-formed
/// TorchScript archive within those bounds.
void check_script_archive(const std::string& path);

}  // namespace shoal::checkpoint::detail
