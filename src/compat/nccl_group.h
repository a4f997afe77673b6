// NcclGroup: c10d's ProcessGroupNCCL behind the C10dGroup interface (LibTorch 2.x with CUDA;
// compiled only when SHOAL_HAVE_NCCL). Also the few CUDA queries the NCCL backend needs.
//
// Thread safety: as C10dGroup.
#pragma once

#include <memory>

#include "compat/c10d_group.h"
#include "shoal/comm/store.h"

namespace shoal::compat {

/// Number of CUDA devices this process sees (0 without a GPU or driver; never throws).
int cuda_device_count();

/// Makes `index` this thread's current CUDA device (NCCL's communicator binds to it).
void set_cuda_device(int index);

class NcclGroup : public C10dGroup {
 public:
  /// Creates c10d's ProcessGroupNCCL over `store` (its communicators are made on first use).
  /// `timeout` is NCCL's watchdog time-out for every operation. Throws when there is no GPU.
  NcclGroup(std::shared_ptr<comm::Store> store, int rank, int size, comm::Milliseconds timeout);
};

}  // namespace shoal::compat
