// The built-in communication hooks of DistributedDataParallel (PyTorch's
// torch.distributed.algorithms.ddp_comm_hooks.default_hooks): plain allreduce, and allreduce with
// the bucket compressed to float16 or bfloat16 (half the bytes on the wire, ~3 significant digits).
//
// Thread safety: the returned hooks hold the process group; DDP calls them from one thread.
#pragma once

#include <memory>

#include "shoal/comm/process_group.h"
#include "shoal/parallel/grad_bucket.h"

namespace shoal::parallel {

/// Averages the bucket across ranks with an allreduce of ReduceOp::kAvg (DDP's default).
CommHook allreduce_hook(std::shared_ptr<comm::ProcessGroup> group);

/// Casts the bucket to float16, averages it across ranks, and casts the result back.
CommHook fp16_compress_hook(std::shared_ptr<comm::ProcessGroup> group);

/// Casts the bucket to bfloat16, averages it across ranks, and casts the result back.
CommHook bf16_compress_hook(std::shared_ptr<comm::ProcessGroup> group);

}  // namespace shoal::parallel
