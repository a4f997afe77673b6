// Small value types shared by every part of the communication layer.
//
// Thread safety: plain values; safe to copy between threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace shoal::comm {

using Milliseconds = std::chrono::milliseconds;

/// The default time-out of every blocking operation: long enough for a slow first connection on a
/// loaded machine, short enough that a dead peer is reported while someone is still watching.
/// The SHOAL_TIMEOUT environment variable (milliseconds, or with an s/ms suffix) overrides it.
constexpr Milliseconds kDefaultTimeout{30'000};

/// Passed as an operation's timeout: use the process group's timeout.
constexpr Milliseconds kGroupTimeout{-1};

/// Reads SHOAL_TIMEOUT ("30000", "30s", "500ms"), falling back to `fallback`.
/// Throws InvalidArgument when the variable is set but not a positive duration.
Milliseconds timeout_from_env(Milliseconds fallback = kDefaultTimeout);

/// Reduction applied by allreduce, reduce and reduce_scatter (PyTorch's torch.distributed.ReduceOp).
enum class ReduceOp { kSum, kAvg, kMin, kMax, kProduct };

/// "sum", "avg", "min", "max", "product".
const char* to_string(ReduceOp op);

}  // namespace shoal::comm
