// detect_rank_info: the one place that turns a launcher's environment (torchrun and `shoal run`,
// OpenMPI, PMI, SLURM) into rank, world size, local rank and the rendezvous endpoint, and decides
// whether this process was started as one rank of a job.
#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <string>

#include "comm/slurm_hostlist.h"
#include "shoal/comm/init.h"
#include "shoal/error.h"

namespace shoal::comm {
namespace {

// Why this range: see slurm_master_port in init.h.
constexpr long long kSlurmPortBase = 15000;
constexpr long long kSlurmPortSpan = 15000;
// Concurrent steps of one job that get ports of their own.
constexpr long long kSlurmStepsPerJob = 16;

// Why a bound: a rendezvous keeps a flag per rank and each rank asks the store about every
// other; no job runs a million ranks, and a corrupt or hostile count (SLURM_NTASKS=1000000000)
// should be one line, not minutes of store traffic and a gigabyte of flags.
constexpr int kMaxWorldSize = 1 << 20;

/// The variable a world size was read from, for messages.
const char* world_size_variable(const std::string& source) {
  if (source == "slurm") return "SLURM_STEP_NUM_TASKS or SLURM_NTASKS";
  if (source == "torchrun") return "WORLD_SIZE";
  if (source == "openmpi") return "OMPI_COMM_WORLD_SIZE";
  if (source == "pmi") return "PMI_SIZE";
  return "the world size given";
}

const char* env(const char* name) {
  const char* value = std::getenv(name);
  return (value != nullptr && *value != '\0') ? value : nullptr;
}

// The first of the variables that is set, or nullptr.
const char* first_env(std::initializer_list<const char*> names, const char** which = nullptr) {
  for (const char* name : names) {
    if (const char* value = env(name)) {
      if (which != nullptr) *which = name;
      return value;
    }
  }
  return nullptr;
}

int parse_int(const char* name, const char* value) {
  char* end = nullptr;
  const long parsed = std::strtol(value, &end, 10);
  SHOAL_CHECK_T(InvalidArgument, end != value && *end == '\0' && parsed >= 0 && parsed < (1 << 30),
                "environment variable ", name, "='", value, "' is not a non-negative integer");
  return static_cast<int>(parsed);
}

int env_int(const char* name, int fallback) {
  const char* value = env(name);
  return value == nullptr ? fallback : parse_int(name, value);
}

// The first of the variables that is set, as an integer; `fallback` when none is.
int first_env_int(std::initializer_list<const char*> names, int fallback) {
  const char* which = nullptr;
  const char* value = first_env(names, &which);
  return value == nullptr ? fallback : parse_int(which, value);
}

// SLURM_TASKS_PER_NODE reads "2(x3),1": tasks on each node, in node order; returns node `node`'s.
int slurm_tasks_on_node(const char* name, const std::string& text, int node) {
  auto fail = [&]() {
    SHOAL_THROW(InvalidArgument, name, "='", text,
                "' is not understood (SLURM writes it like 2(x3),1)");
  };
  size_t pos = 0;
  int index = 0;
  try {
    while (pos < text.size()) {
      size_t used = 0;
      const int tasks = std::stoi(text.substr(pos), &used);
      pos += used;
      int repeat = 1;
      if (pos < text.size() && text[pos] == '(') {
        if (text.compare(pos, 2, "(x") != 0) fail();
        pos += 2;
        repeat = std::stoi(text.substr(pos), &used);
        pos += used;
        if (pos >= text.size() || text[pos] != ')') fail();
        ++pos;
      }
      if (node < index + repeat) return tasks;
      index += repeat;
      if (pos < text.size() && text[pos] != ',') fail();
      if (pos < text.size()) ++pos;
    }
  } catch (const std::logic_error&) {  // std::stoi on something that is not a number
    fail();
  }
  SHOAL_THROW(InvalidArgument, name, "='", text, "' has no entry for node ", node,
              " (SLURM_NODEID)");
}

// A task of a job step (srun), not the batch script: sbatch gives its script SLURM_PROCID=0 and the
// job's SLURM_NTASKS, but no step id, and that script is not a rank of anything.
bool in_slurm_step() {
  return env("SLURM_PROCID") != nullptr && first_env({"SLURM_STEP_ID", "SLURM_STEPID"}) != nullptr;
}

void read_slurm(RankInfo& info) {
  info.source = "slurm";
  info.rank = env_int("SLURM_PROCID", 0);
  info.world_size = first_env_int({"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"}, 1);
  info.local_rank = env_int("SLURM_LOCALID", 0);
  const int node = env_int("SLURM_NODEID", 0);
  const char* which = nullptr;
  if (const char* spec = first_env({"SLURM_STEP_TASKS_PER_NODE"}, &which)) {
    info.local_world_size = slurm_tasks_on_node(which, spec, node);
  } else if (env("SLURM_NTASKS_PER_NODE") != nullptr) {  // an explicit --ntasks-per-node
    info.local_world_size = env_int("SLURM_NTASKS_PER_NODE", 1);
  } else if (const char* spec = first_env({"SLURM_TASKS_PER_NODE"}, &which)) {
    info.local_world_size = slurm_tasks_on_node(which, spec, node);
  } else {
    info.local_world_size = 1;
  }
  // One task is a lone process in its allocation: it may start ranks of its own (`srun -n1 shoal
  // train --strategy ddp --nproc-per-node 4`), as torchrun inside srun does.
  info.launched = info.world_size > 1;
}

// MASTER_ADDR/MASTER_PORT as given, or, under srun, from the job.
void read_endpoint(RankInfo& info) {
  const char* addr = env("MASTER_ADDR");
  const char* port = env("MASTER_PORT");
  if (addr != nullptr) info.master_addr = addr;
  if (port != nullptr) info.master_port = parse_int("MASTER_PORT", port);
  if (addr != nullptr && port != nullptr) {
    info.endpoint_source = "env";
    return;
  }
  if (info.source != "slurm") return;
  // Without the node list or the job id (not an srun SLURM sets up) the endpoint stays unknown, and
  // an env:// rendezvous says MASTER_ADDR/MASTER_PORT are needed.
  const char* which = nullptr;
  const char* list =
      first_env({"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}, &which);
  const char* job = first_env({"SLURM_JOB_ID", "SLURM_JOBID"});
  if ((addr == nullptr && list == nullptr) || (port == nullptr && job == nullptr)) return;
  if (addr == nullptr) {
    const auto hosts = expand_slurm_hostlist(list, which, /*max_hosts=*/1);  // rank 0's host
    SHOAL_CHECK_T(InvalidArgument, !hosts.empty(), which, "='", list,
                  "' names no host: set MASTER_ADDR to rank 0's host");
    info.master_addr = hosts.front();
  }
  if (port == nullptr) {
    // A heterogeneous job's step reads "0+1": its first number is the step.
    const char* step = first_env({"SLURM_STEP_ID", "SLURM_STEPID"});
    info.master_port = slurm_master_port(std::strtoll(job, nullptr, 10),
                                         step != nullptr ? std::strtoll(step, nullptr, 10) : 0);
  }
  info.endpoint_source = "slurm";
}

}  // namespace

int slurm_master_port(long long job_id, long long step_id) {
  const long long step = ((step_id % kSlurmStepsPerJob) + kSlurmStepsPerJob) % kSlurmStepsPerJob;
  const long long job = job_id < 0 ? -job_id : job_id;
  return static_cast<int>(kSlurmPortBase +
                          ((job % kSlurmPortSpan) * kSlurmStepsPerJob + step) % kSlurmPortSpan);
}

RankInfo detect_rank_info(const InitOptions& options) {
  RankInfo info;
  if (env("RANK") != nullptr || env("WORLD_SIZE") != nullptr) {
    info.source = "torchrun";
    info.rank = env_int("RANK", 0);
    info.world_size = env_int("WORLD_SIZE", 1);
    info.local_rank = env_int("LOCAL_RANK", info.rank);
    info.local_world_size = env_int("LOCAL_WORLD_SIZE", info.world_size);
    info.launched = true;
  } else if (env("OMPI_COMM_WORLD_RANK") != nullptr) {
    info.source = "openmpi";
    info.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
    info.world_size = env_int("OMPI_COMM_WORLD_SIZE", 1);
    info.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    info.local_world_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", info.world_size);
    info.launched = true;
  } else if (env("PMI_RANK") != nullptr) {
    // MPICH's hydra and Intel MPI. Without the local variables nothing says which ranks share
    // this host: each is taken to be alone on it (correct across hosts, slower on one).
    info.source = "pmi";
    info.rank = env_int("PMI_RANK", 0);
    info.world_size = env_int("PMI_SIZE", 1);
    info.local_rank = env_int("MPI_LOCALRANKID", 0);
    info.local_world_size = env_int("MPI_LOCALNRANKS", 1);
    info.launched = true;
  } else if (in_slurm_step()) {
    read_slurm(info);
  }
  if (options.rank >= 0 || options.world_size >= 0) {
    info.source = "options";
    if (options.rank >= 0) info.rank = options.rank;
    if (options.world_size >= 0) info.world_size = options.world_size;
    if (options.world_size >= 0 && env("LOCAL_WORLD_SIZE") == nullptr) {
      info.local_rank = info.rank;
      info.local_world_size = info.world_size;
    }
  }
  read_endpoint(info);

  SHOAL_CHECK_T(InvalidArgument, info.world_size >= 1, "world size is ", info.world_size,
                " (from ", info.source, "); it must be at least 1");
  SHOAL_CHECK_T(InvalidArgument, info.world_size <= kMaxWorldSize, "world size ", info.world_size,
                " (", world_size_variable(info.source), ") is more than ", kMaxWorldSize,
                ", more ranks than any job runs: check the variable");
  SHOAL_CHECK_T(InvalidArgument, info.rank < info.world_size, "rank ", info.rank,
                " is not below the world size ", info.world_size, " (from ", info.source,
                "); ranks are 0..", info.world_size - 1);
  SHOAL_CHECK_T(InvalidArgument, info.local_rank < std::max(1, info.local_world_size),
                "local rank ", info.local_rank, " is not below the local world size ",
                info.local_world_size, " (from ", info.source, ")");
  return info;
}

}  // namespace shoal::comm
