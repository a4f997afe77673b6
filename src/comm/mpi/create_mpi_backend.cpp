// Placeholder until the OpenMPI backend lands (issue: communication layer).
#include "comm/backends.h"
#include "shoal/error.h"

namespace shoal::comm {

std::shared_ptr<ProcessGroup> create_mpi_backend(const BackendArgs&) {
  SHOAL_THROW(InvalidArgument, "the mpi backend is not available yet; use --backend gloo");
}

}  // namespace shoal::comm
