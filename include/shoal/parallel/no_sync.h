// The guard of PyTorch's `with model.no_sync():`, shared by DistributedDataParallel and
// FullyShardedDataParallel: while alive, backward passes accumulate gradients locally without
// communicating; the first synchronised backward after it reduces the accumulated sum.
//
// Thread safety: movable, not shared between threads (as the wrapper it guards).
#pragma once

#include <functional>

namespace shoal::parallel {

class NoSyncGuard {
 public:
  /// `set_sync(enabled)` switches the wrapper's gradient synchronisation and returns what it was;
  /// the guard turns it off now and restores the previous value when it ends.
  explicit NoSyncGuard(std::function<bool(bool)> set_sync);
  NoSyncGuard(NoSyncGuard&& other) noexcept;
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;
  ~NoSyncGuard();

 private:
  std::function<bool(bool)> set_sync_;  // empty once moved from
  bool previous_ = true;
};

}  // namespace shoal::parallel
