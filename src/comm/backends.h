// The constructors of every backend, called by init_process_group and new_process_group
// (private to the library). A backend that is not compiled in is never referenced, so its folder
// can be left out of the build (src/comm/mpi without OpenMPI, src/comm/nccl without CUDA).
#pragma once

#include <memory>

#include "shoal/comm/init.h"

namespace shoal::comm {

struct BackendArgs {
  std::shared_ptr<Store> store;  // rendezvous store, already scoped for this group
  int rank = 0;
  int size = 1;
  Milliseconds timeout = kDefaultTimeout;
  RankInfo info;                 // where the job runs (hosts, master address)
};

std::shared_ptr<ProcessGroup> create_gloo_backend(const BackendArgs& args);
std::shared_ptr<ProcessGroup> create_shm_backend(const BackendArgs& args);
std::shared_ptr<ProcessGroup> create_hierarchical_backend(const BackendArgs& args);
#if SHOAL_HAVE_MPI
std::shared_ptr<ProcessGroup> create_mpi_backend(const BackendArgs& args);
#endif
#if SHOAL_HAVE_NCCL
std::shared_ptr<ProcessGroup> create_nccl_backend(const BackendArgs& args);
#endif

}  // namespace shoal::comm
