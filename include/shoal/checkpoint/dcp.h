// PyTorch's distributed checkpoint (DCP) format, written: a folder holding `.metadata` (a pickle
// of torch.distributed.checkpoint.metadata.Metadata: each tensor's dtype, size and chunks, and
// where each chunk's bytes are) and `__0_0.distcp` (each tensor torch.save'd, one after the
// other), as `torch.distributed.checkpoint.save` writes it from one process. So
// `torch.distributed.checkpoint.load(model.state_dict(), checkpoint_id=folder)` fills a PyTorch
// model, plain or FSDP2-sharded on any number of ranks (DCP reshards on load), from a Shoal model.
//
// Thread safety: a plain function.
#pragma once

#include <string>

#include "shoal/checkpoint/state_dict.h"

namespace shoal::checkpoint {

/// Writes `state` (its keys as the fully qualified names DCP loads by) as a DCP checkpoint into
/// `folder`, which must not exist or be empty. The data file is written first and `.metadata`
/// last, each atomically: a folder cut short by a crash has no `.metadata` and DCP refuses it.
/// Throws CheckpointError naming the folder.
void save_dcp(const StateDict& state, const std::string& folder);

}  // namespace shoal::checkpoint
