// The samples one rank of a data-parallel job visits in an epoch: its DistributedSampler shard
// (shuffled with seed + epoch, padded to equal shares), as a tensor for fast batch slicing.
// Shared by the strategies that deal the data out by rank (DDP, parameter-server workers).
//
// Thread safety: a pure function.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace shoal::train {

/// [k] int64 indices of rank `rank` of `world_size` for `epoch`, in visiting order.
at::Tensor distributed_epoch_indices(int64_t dataset_size, int rank, int world_size,
                                     int64_t epoch, uint64_t seed);

}  // namespace shoal::train
