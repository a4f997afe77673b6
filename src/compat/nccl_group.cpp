#include "compat/nccl_group.h"

#if SHOAL_HAVE_NCCL

#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "compat/c10d_group_impl.h"
#include "compat/c10d_store.h"
#include "compat/c10d_store_ref.h"

namespace shoal::compat {

int cuda_device_count() {
  // c10::cuda::device_count() returns 0 (and warns once) when there is no driver or device.
  return static_cast<int>(c10::cuda::device_count());
}

void set_cuda_device(int index) { c10::cuda::set_device(static_cast<c10::DeviceIndex>(index)); }

NcclGroup::NcclGroup(std::shared_ptr<comm::Store> store, int rank, int size,
                     comm::Milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto ref = to_c10d_store(store);
  impl_->pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(ref->store, rank, size, options);
  impl_->native_avg = true;
}

}  // namespace shoal::compat

#endif  // SHOAL_HAVE_NCCL
