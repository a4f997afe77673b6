// Placeholder until the shared-memory backend lands (issue: shm and hierarchical backends).
#include "comm/backends.h"
#include "shoal/error.h"

namespace shoal::comm {

std::shared_ptr<ProcessGroup> create_shm_backend(const BackendArgs&) {
  SHOAL_THROW(InvalidArgument, "the shm backend is not available yet; use --backend gloo");
}

std::shared_ptr<ProcessGroup> create_hierarchical_backend(const BackendArgs&) {
  SHOAL_THROW(InvalidArgument, "the hierarchical backend is not available yet; use --backend gloo");
}

}  // namespace shoal::comm
