#include "shoal/comm/init.h"

#include <cstdlib>
#include <map>

#include "comm/backends.h"
#include "comm/c10d_wire_store.h"
#include "comm/gloo/process_group_gloo.h"
#include "comm/multi_device/process_group_multi_device.h"
#include "comm/peer_directory.h"
#include "comm/rendezvous.h"
#include "comm/timeouts.h"
#include "compat/c10d_store.h"
#if SHOAL_HAVE_NCCL
#include "compat/nccl_group.h"
#endif
#include "shoal/comm/flight_recorder.h"
#include "shoal/env.h"
#include "shoal/error.h"
#include "shoal/log.h"

namespace shoal::comm {
namespace {

const char* init_env(const char* name) {
  const char* value = std::getenv(name);
  return (value != nullptr && *value != '\0') ? value : nullptr;
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

// torchrun's elastic agent serves the rendezvous store itself (PyTorch 2.x, and 1.x >= 1.9).
bool torchelastic_agent_store() {
  const char* value = init_env("TORCHELASTIC_USE_AGENT_STORE");
  return value != nullptr && std::string(value) == "True";
}

// Whether that agent is PyTorch 2.x's: every 2.x torchrun since 2.2 gives its workers
// TORCH_NCCL_ASYNC_ERROR_HANDLING (1.x's give NCCL_ASYNC_ERROR_HANDLING). 2.0 and 2.1 set neither
// and count as 1.x here.
bool torchelastic_agent_is_2x() { return init_env("TORCH_NCCL_ASYNC_ERROR_HANDLING") != nullptr; }

}  // namespace

bool is_backend_available(const std::string& backend) {
  if (is_multi_device_spec(backend)) {
    try {
      for (const auto& part : parse_multi_device_spec(backend)) {
        if (!is_backend_available(part.second)) return false;
      }
      return true;
    } catch (const InvalidArgument&) {
      return false;
    }
  }
  if (backend == "gloo" || backend == "shm" || backend == "hierarchical") return true;
  if (backend == "mpi") return SHOAL_HAVE_MPI;
  if (backend == "nccl") return SHOAL_HAVE_NCCL;
  return false;
}

namespace {

// Whether `auto` should give CUDA tensors to NCCL: built against a CUDA LibTorch, and a GPU for
// each of this host's ranks (NCCL refuses two ranks on one GPU; with fewer GPUs, CUDA tensors go
// through host memory on the CPU backend instead).
bool cuda_available_for_nccl(int local_world_size) {
#if SHOAL_HAVE_NCCL
  const int gpus = compat::cuda_device_count();
  return gpus > 0 && gpus >= local_world_size;
#else
  return false;
#endif
}

std::shared_ptr<ProcessGroup> create_backend(const std::string& name, const BackendArgs& args);

std::shared_ptr<ProcessGroup> create_named_backend(const std::string& name,
                                                   const BackendArgs& args) {
  if (is_multi_device_spec(name)) {
    // A backend per device type, each meeting in a store prefix of its own ("cpu:shm,cuda:nccl").
    std::map<c10::DeviceType, std::shared_ptr<ProcessGroup>> children;
    for (const auto& [type, backend] : parse_multi_device_spec(name)) {
      SHOAL_CHECK_T(InvalidArgument, !is_multi_device_spec(backend) && backend != "auto", "backend '",
                    name, "': each device type needs a concrete backend, not '", backend, "'");
      BackendArgs child = args;
      if (args.store) {
        child.store = make_prefix_store(type == c10::DeviceType::CPU ? "cpu" : "cuda", args.store);
      }
      children[type] = create_backend(backend, child);
    }
    return std::make_shared<ProcessGroupMultiDevice>(std::move(children), args.timeout);
  }
  if (name == "gloo") return create_gloo_backend(args);
  if (name == "shm") return create_shm_backend(args);
  if (name == "hierarchical") return create_hierarchical_backend(args);
  if (name == "mpi") {
#if SHOAL_HAVE_MPI
    return create_mpi_backend(args);
#else
    SHOAL_THROW(InvalidArgument,
                "the mpi backend is not built in: OpenMPI was not found when Shoal was built; "
                "install libopenmpi-dev and rebuild, or use --backend gloo");
#endif
  }
  if (name == "nccl") {
#if SHOAL_HAVE_NCCL
    return create_nccl_backend(args);
#else
    SHOAL_THROW(InvalidArgument,
                "the nccl backend is not built in: this Shoal was built against a LibTorch "
                "without CUDA; build against a CUDA LibTorch (-DCMAKE_PREFIX_PATH=<torch>/share/"
                "cmake), or use --backend shm or gloo for CPU tensors");
#endif
  }
  SHOAL_THROW(InvalidArgument, "unknown backend '", name,
              "'; choose one of auto, shm, gloo, mpi, nccl, hierarchical, or one per device type "
              "(cpu:shm,cuda:nccl)");
}

// Every backend's time-outs then name every rank's last operations (hang_reporter.h). The
// hierarchical and multi-device groups' time-outs arise in their sub-groups, which report for
// themselves.
std::shared_ptr<ProcessGroup> create_backend(const std::string& name, const BackendArgs& args) {
  auto group = create_named_backend(name, args);
  if (name != "hierarchical" && !is_multi_device_spec(name)) {
    group->enable_hang_reports(args.store, "shoal/hang");
  }
  return group;
}

}  // namespace

std::shared_ptr<ProcessGroup> new_process_group(const std::string& backend,
                                                std::shared_ptr<Store> store, int rank,
                                                int world_size, Milliseconds timeout) {
  BackendArgs args;
  args.store = std::move(store);
  args.rank = rank;
  args.size = world_size;
  args.timeout = timeout;
  args.info.rank = rank;
  args.info.world_size = world_size;
  args.info.local_rank = rank;
  args.info.local_world_size = world_size;
  args.info.source = "options";
  // new_process_group's ranks all run on this host (threads or local processes): shm.
  return create_backend(backend == "auto" ? "shm" : backend, args);
}

std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options) {
  // A hung job can be asked what it was doing: kill -USR1 <pid> (flight_recorder.h).
  install_dump_on_sigusr1();
  RankInfo info = detect_rank_info(options);
  const Milliseconds timeout =
      options.timeout == kGroupTimeout ? timeout_from_env(kJobTimeout) : options.timeout;

  std::string backend = options.backend;
  if (backend == "auto") {
    if (const auto chosen = env::text(env::Var::kBackend)) backend = *chosen;
  }
  if (backend == "auto") {
    const bool one_host = info.local_world_size >= info.world_size;
    if (info.source == "openmpi" && init_env("MASTER_ADDR") == nullptr && SHOAL_HAVE_MPI) {
      backend = "mpi";  // started by mpirun with nothing else to meet through
    } else {
      // Shared memory on one host; across hosts, shared memory inside each and Gloo between them.
      backend = one_host ? "shm" : "hierarchical";
      // With a GPU, CUDA tensors go to NCCL and CPU tensors still to shm/hierarchical, as
      // PyTorch 2.x's default group does ("cpu:gloo,cuda:nccl").
      if (cuda_available_for_nccl(info.local_world_size)) backend = "cpu:" + backend + ",cuda:nccl";
    }
  }

  BackendArgs args;
  args.rank = info.rank;
  args.size = info.world_size;
  args.timeout = timeout;
  args.info = info;
  log::debug("[rank ", info.rank, "/", info.world_size, "] init_process_group: backend ", backend,
             ", rank information from ", info.source, ", init method ",
             backend == "mpi" ? std::string("mpi") : options.init_method, ", timeout ",
             timeout.count(), " ms");
  if (backend == "mpi") return create_backend(backend, args);

  std::shared_ptr<Store> store;
  const std::string& method = options.init_method;
  if (method == "env://" || method.empty()) {
    if (info.world_size == 1) {
      store = make_hash_store(timeout);
    } else {
      // Without them, two unrelated jobs on one host would silently meet on the same default.
      // SLURM derives them from the job (detect_rank_info); other launchers set them.
      SHOAL_CHECK_T(InvalidArgument, !info.endpoint_source.empty(),
                    "[rank ", info.rank, "/", info.world_size, "] env:// rendezvous needs MASTER_ADDR and ",
                    "MASTER_PORT (", init_env("MASTER_ADDR") ? "MASTER_PORT" : "MASTER_ADDR",
                    " is not set): set both on every rank to rank 0's host and a free port, or start the ",
                    "job with `shoal run` or srun, which provide them");
      const bool multi_host = info.local_world_size < info.world_size;
      SHOAL_CHECK_T(InvalidArgument, !(multi_host && is_loopback(info.master_addr)),
                    "MASTER_ADDR=", info.master_addr, " is a loopback address but the job spans ",
                    "several hosts (LOCAL_WORLD_SIZE ", info.local_world_size, " < WORLD_SIZE ",
                    info.world_size, "); set MASTER_ADDR to rank 0's address on the network");
      // Under torchrun (elastic agent), the agent already serves the store at MASTER_ADDR:
      // MASTER_PORT: every rank joins it as a client, in this restart attempt's own key space.
      // LibTorch's own client speaks to an agent of its own generation; under LibTorch 1.13 a
      // 2.x agent's store gets Shoal's own client of c10d 2.x's protocol. Only LibTorch 2.x
      // under a 1.x agent (whose protocol no client here speaks) leaves the ranks to meet on a
      // store of their own that rank 0 serves on the next port.
      const bool under_agent = torchelastic_agent_store();
      const bool agent_2x = torchelastic_agent_is_2x();
      const bool libtorch_client = under_agent && compat::can_join_torchrun_agent_store(agent_2x);
      const bool wire_client = under_agent && !libtorch_client && agent_2x;
      const bool own_store = !libtorch_client && !wire_client;
      const int port = under_agent && own_store ? info.master_port + 1 : info.master_port;
      if (libtorch_client) {
        store = make_c10d_tcp_store_client(info.master_addr, port, timeout);
      } else if (wire_client) {
        store = std::make_shared<C10dWireStore>(info.master_addr, port, info.rank, timeout);
      } else {
        // Shoal's authenticated store, which rank 0 serves.
        store = make_tcp_store(info.master_addr, port, info.world_size, info.rank == 0, timeout);
      }
      if (!own_store) {
        store = make_prefix_store(
            "/worker/attempt_" + std::to_string(env::integer(env::Var::kRestartCount).value_or(0)), store);
      }
    }
  } else if (method.rfind("tcp://", 0) == 0) {
    const std::string hostport = method.substr(6);
    const auto colon = hostport.rfind(':');
    SHOAL_CHECK_T(InvalidArgument, colon != std::string::npos && colon + 1 < hostport.size(),
                  "init method '", method, "' has no port; write tcp://HOST:PORT");
    info.master_addr = hostport.substr(0, colon);
    char* end = nullptr;
    const long port = std::strtol(hostport.c_str() + colon + 1, &end, 10);
    SHOAL_CHECK_T(InvalidArgument, *end == '\0' && port > 0 && port < 65536, "init method '",
                  method, "' has an invalid port; write tcp://HOST:PORT with PORT in 1..65535");
    info.master_port = static_cast<int>(port);
    args.info = info;
    store = make_tcp_store(info.master_addr, info.master_port, info.world_size, info.rank == 0,
                           timeout);
  } else if (method.rfind("file://", 0) == 0) {
    store = make_file_store(method.substr(7), info.world_size, timeout);
  } else {
    SHOAL_THROW(InvalidArgument, "init method '", method,
                "' is not understood; use env://, tcp://HOST:PORT or file:///PATH");
  }

  rendezvous(*store, info.rank, info.world_size, timeout);
  args.store = make_prefix_store("shoal/pg", store);
  return create_backend(backend, args);
}

std::shared_ptr<ProcessGroup> create_gloo_backend(const BackendArgs& args) {
  GlooOptions options;
  const bool one_host = args.info.local_world_size >= args.info.world_size;
  if (const auto iface = env::text(env::Var::kGlooSocketIfname)) options.interface = *iface;
  options.hostname = one_host ? "127.0.0.1" : local_hostname();
  return std::make_shared<ProcessGroupGloo>(args.store, args.rank, args.size, args.timeout,
                                            options);
}

}  // namespace shoal::comm
