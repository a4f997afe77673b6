// The shm backend's entry point for init_process_group and new_process_group.
#include "comm/backends.h"
#include "comm/shm/process_group_shm.h"

namespace shoal::comm {

std::shared_ptr<ProcessGroup> create_shm_backend(const BackendArgs& args) {
  return shm::make_shm_group(args.store, args.rank, args.size, args.timeout);
}

}  // namespace shoal::comm
