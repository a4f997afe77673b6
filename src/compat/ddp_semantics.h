// Where PyTorch's own DistributedDataParallel behaves differently from one version to the next,
// Shoal's DDP behaves as the PyTorch whose LibTorch it is built against (so the 1.13 leg equals
// Python's PyTorch 1.13 and the 2.x leg PyTorch 2.x; test_ddp_vs_pytorch compares each leg with
// its own PyTorch).
//
// Thread safety: pure functions.
#pragma once

namespace shoal::compat {

/// With find_unused_parameters: whether a parameter whose gradient was accumulated in a no_sync()
/// backward counts as locally used in the next synchronised step, so that its accumulated .grad
/// is reduced (and the replicas stay equal) even when the synchronised backward itself does not
/// use it. PyTorch 2.x (checked on 2.15): yes; 1.13: no (only the synchronised backward's own use
/// counts, and such a parameter's .grad is left alone on every rank).
bool ddp_no_sync_use_counts();

}  // namespace shoal::compat
