// init_process_group: find out who this process is and meet the others.
//
// Reads the rank and world size from the options, or from the environment the launchers set:
// torchrun's RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT (set by
// `shoal run`), OpenMPI's OMPI_COMM_WORLD_*, or SLURM's SLURM_PROCID/SLURM_NTASKS/...
// Inconsistent settings (rank >= world size, two processes claiming one rank, world sizes that
// disagree) are reported as InvalidArgument, never hung on.
//
// Thread safety: call from one thread per process.
#pragma once

#include <memory>
#include <string>

#include "shoal/comm/process_group.h"
#include "shoal/comm/store.h"

namespace shoal::comm {

struct InitOptions {
  /// "auto" (shm on one host, hierarchical across hosts; with a GPU and NCCL built in,
  /// "cpu:shm,cuda:nccl": CUDA tensors to NCCL), "gloo", "shm", "mpi",
  /// "nccl", "hierarchical", or a backend per device type as in PyTorch 2.x: "cpu:gloo,cuda:nccl"
  /// (CPU tensors to the first, CUDA tensors to the second). The SHOAL_BACKEND environment
  /// variable overrides "auto".
  std::string backend = "auto";
  /// "env://" (default), "tcp://host:port", "file:///path/to/file".
  std::string init_method = "env://";
  /// -1: from the environment.
  int rank = -1;
  int world_size = -1;
  /// kGroupTimeout: SHOAL_TIMEOUT or kDefaultTimeout.
  Milliseconds timeout = kGroupTimeout;
};

/// Where this process stands in the job, as read from options and environment.
struct RankInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  /// "options", "torchrun", "openmpi", "slurm" or "default" (a lone process).
  std::string source = "default";
};

/// Reads rank, world size, local rank and master address from the options and the environment.
RankInfo detect_rank_info(const InitOptions& options = {});

/// Creates the process group this process belongs to.
std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options = {});

/// Creates a process group of a named backend over an existing store (tests, tools).
std::shared_ptr<ProcessGroup> new_process_group(const std::string& backend,
                                                std::shared_ptr<Store> store, int rank,
                                                int world_size,
                                                Milliseconds timeout = kDefaultTimeout);

/// True when the named backend is compiled into this build ("mpi", "nccl" may not be).
bool is_backend_available(const std::string& backend);

}  // namespace shoal::comm
