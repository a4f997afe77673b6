// init_process_group: find out who this process is and meet the others.
//
// Reads the rank and world size from the options, or from the environment the launchers set:
// torchrun's RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT (set by
// `shoal run`), OpenMPI's OMPI_COMM_WORLD_*, PMI's PMI_RANK/PMI_SIZE, or an srun step's
// SLURM_PROCID/SLURM_STEP_NUM_TASKS/... with the rendezvous derived from the job
// (detect_rank_info, src/comm/cluster_environment.cpp: the one place that decides this).
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
  /// "options", "torchrun" (also `shoal run`), "openmpi", "pmi" (MPICH, Intel MPI), "slurm"
  /// (a task of an srun step) or "default" (a lone process).
  std::string source = "default";
  /// True when a launcher started this process as one rank of a job (torchrun, `shoal run`,
  /// mpirun, an MPICH launcher, or srun with more than one task): such a process must never launch
  /// a job of its own. The one place that decides it; every entry point asks here.
  bool launched = false;
  /// Where master_addr/master_port came from: "env" (MASTER_ADDR/MASTER_PORT), "slurm" (the first
  /// host of the step's node list and a port derived from the job id), or "" (the defaults above:
  /// env:// rendezvous across processes then refuses to guess).
  std::string endpoint_source;
};

/// Reads rank, world size, local rank and the rendezvous endpoint from the options and the
/// environment, first match wins: torchrun's RANK/WORLD_SIZE (`shoal run` sets them too), OpenMPI's
/// OMPI_COMM_WORLD_*, PMI's PMI_RANK/PMI_SIZE (MPI_LOCALRANKID/MPI_LOCALNRANKS), SLURM's
/// SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_LOCALID/SLURM_STEP_TASKS_PER_NODE/SLURM_NODEID (only in a
/// job step, i.e. under srun: a batch script's own SLURM_PROCID=0 is not a rank). MASTER_ADDR and
/// MASTER_PORT win when set; under srun without them, MASTER_ADDR is the first host of
/// SLURM_STEP_NODELIST (SLURM_JOB_NODELIST) and MASTER_PORT is slurm_master_port().
RankInfo detect_rank_info(const InitOptions& options = {});

/// The rendezvous port of a SLURM job step without MASTER_PORT:
/// 15000 + (job_id * 16 + step_id % 16) % 15000, in [15000, 30000): below Linux's ephemeral
/// ports (32768-60999, where outgoing connections take theirs) and above SLURM's own (6817-6819).
/// The same on every task of a step without a word exchanged; 16 concurrent steps of one job, and
/// jobs whose ids differ by less than 937, get different ports.
int slurm_master_port(long long job_id, long long step_id);

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
