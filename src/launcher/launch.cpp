// launch(): checks the options, decides each worker's identity and environment, and runs one
// WorkerGroup attempt. (A restart loop goes around the attempt, here, when `--max-restarts` comes.)
#include "shoal/launcher/launch.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <thread>

#include "comm/shm/shared_segment.h"
#include "comm/tcp_store_server.h"
#include "launcher/elastic_rendezvous.h"
#include "launcher/signal_relay.h"
#include "log/error_file.h"
#include "shoal/comm/flight_recorder.h"
#include "shoal/comm/store.h"
#include "shoal/parallel/fault_tolerant_manager.h"
#include "launcher/worker_group.h"
#include "security/auth_token.h"
#include "checkpoint/temp_dir.h"
#include "shoal/env.h"
#include "shoal/error.h"
#include "shoal/log.h"

extern char** environ;

namespace shoal::launcher {
namespace {

// Why 65536: a sanity bound on one node; far above any machine's core or GPU count.
constexpr int kMaxProcessesPerNode = 65536;

bool elastic(const LaunchOptions& options) {
  return options.min_nnodes > 0 && options.min_nnodes < options.nnodes;
}

// --nnodes MIN:MAX: fault-tolerant workers only (see elastic_rendezvous.h).
void validate_node_range(const LaunchOptions& options) {
  SHOAL_CHECK_T(InvalidArgument, options.min_nnodes >= 0 && options.min_nnodes <= options.nnodes,
                "--nnodes ", options.min_nnodes, ":", options.nnodes, ": MIN must not exceed MAX");
  SHOAL_CHECK_T(InvalidArgument, !elastic(options) || options.fault_tolerant,
                "--nnodes ", options.min_nnodes, ":", options.nnodes, ": a node range needs "
                "--fault-tolerant training (nodes join and leave a running job); without it give "
                "a fixed --nnodes N and --max-restarts");
  SHOAL_CHECK_T(InvalidArgument, !elastic(options) || options.roles.size() == 1,
                "--nnodes ", options.min_nnodes, ":", options.nnodes, ": a node range runs workers "
                "only; drop --num-servers");
}

void validate(const LaunchOptions& options) {
  SHOAL_CHECK_T(InvalidArgument, !options.roles.empty(), "nothing to launch: give a program to run");
  for (const RoleSpec& role : options.roles) {
    SHOAL_CHECK_T(InvalidArgument, role.name == "worker" || role.name == "server", "role '",
                  role.name, "' is not supported; roles are 'worker' and 'server'");
    SHOAL_CHECK_T(InvalidArgument,
                  role.nproc_per_node >= 1 && role.nproc_per_node <= kMaxProcessesPerNode,
                  "--nproc-per-node ", role.nproc_per_node, " is out of range; give 1 to ",
                  kMaxProcessesPerNode);
    SHOAL_CHECK_T(InvalidArgument, !role.command.empty() && !role.command[0].empty(),
                  "no program given; write: shoal run --nproc-per-node N PROGRAM [ARGS...]");
  }
  SHOAL_CHECK_T(InvalidArgument, options.roles.front().name == "worker",
                "the first role must be 'worker' (ranks 0.. are the workers; servers follow)");
  SHOAL_CHECK_T(InvalidArgument, options.nnodes >= 1, "--nnodes ", options.nnodes,
                " must be at least 1");
  SHOAL_CHECK_T(InvalidArgument, options.node_rank >= 0 && options.node_rank < options.nnodes,
                "--node-rank ", options.node_rank, " must be in 0..", options.nnodes - 1,
                " (--nnodes ", options.nnodes, ")");
  SHOAL_CHECK_T(InvalidArgument, options.master_port >= 0 && options.master_port <= 65535,
                "--master-port ", options.master_port, " is not a TCP port (1..65535, or 0 for a "
                "free one on a single node)");
  SHOAL_CHECK_T(InvalidArgument, options.grace_period.count() >= 0,
                "--grace-period must not be negative");
  SHOAL_CHECK_T(InvalidArgument, options.max_restarts >= 0, "--max-restarts ", options.max_restarts,
                " must not be negative");
  validate_node_range(options);
  if (options.nnodes > 1) {
    SHOAL_CHECK_T(InvalidArgument, options.master_port != 0,
                  "--master-port 0 (a free port) works on a single node only: with --nnodes ",
                  options.nnodes, " every node must be told the same port; pick one, e.g. "
                  "--master-port 29500");
    SHOAL_CHECK_T(InvalidArgument, !is_loopback_address(options.master_addr),
                  "--master-addr ", options.master_addr, " is a loopback address, but the job "
                  "spans ", options.nnodes, " nodes: the other nodes cannot reach it; give node "
                  "0's address on the network (e.g. --master-addr 10.0.0.1)");
  }
}

// The program to exec: as given when it names a path, else the first match on PATH.
std::string resolve_program(const std::string& program) {
  if (program.find('/') != std::string::npos) return program;
  const char* path = std::getenv("PATH");
  std::string dirs = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    const std::string dir = end > start ? dirs.substr(start, end - start) : ".";
    const std::string candidate = dir + "/" + program;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    start = end + 1;
  }
  SHOAL_THROW(InvalidArgument, "cannot find program '", program, "' on PATH; give its path");
}

void check_token(const LaunchOptions& options) {
  SHOAL_CHECK_T(InvalidArgument, !security::token_from_env().empty() || options.nnodes == 1,
                "a job on ", options.nnodes, " nodes needs the same ", security::kTokenEnv,
                " on every node's `shoal run`: generate one ",
                "(e.g. `head -c 32 /dev/urandom | xxd -p -c 64`) and export it on each node");
}

std::vector<WorkerSpec> plan_workers(const LaunchOptions& options, int master_port, int restart,
                                     const std::string& log_root, const std::string& error_root) {
  // The launcher's own environment, then the job's variables on top.
  std::map<std::string, std::string> base;
  for (char** var = environ; var != nullptr && *var != nullptr; ++var) {
    const char* eq = std::strchr(*var, '=');
    if (eq != nullptr) base[std::string(*var, static_cast<size_t>(eq - *var))] = eq + 1;
  }
  // Ranks: this node's processes of every role, in role order (workers first, then servers);
  // ROLE_RANK and ROLE_WORLD_SIZE count within the role, as under torchrun.
  int local_size = 0;
  for (const RoleSpec& role : options.roles) local_size += role.nproc_per_node;
  const int world_size = options.nnodes * local_size;
  check_token(options);
  std::string token = security::token_from_env();
  if (token.empty()) token = security::generate_token();

  std::vector<WorkerSpec> specs;
  int local_rank = 0;
  for (const RoleSpec& role : options.roles) {
    const std::string program = resolve_program(role.command.front());
    const int role_world_size = options.nnodes * role.nproc_per_node;
    for (int role_local = 0; role_local < role.nproc_per_node; ++role_local, ++local_rank) {
      const int rank = options.node_rank * local_size + local_rank;
      const int role_rank = options.node_rank * role.nproc_per_node + role_local;
      auto env = base;
      env["RANK"] = std::to_string(rank);
      env["LOCAL_RANK"] = std::to_string(local_rank);
      env["WORLD_SIZE"] = std::to_string(world_size);
      env["LOCAL_WORLD_SIZE"] = std::to_string(local_size);
      env["GROUP_RANK"] = std::to_string(options.node_rank);
      env["GROUP_WORLD_SIZE"] = std::to_string(options.nnodes);
      env["ROLE_NAME"] = role.name;
      env["ROLE_RANK"] = std::to_string(role_rank);
      env["ROLE_WORLD_SIZE"] = std::to_string(role_world_size);
      env["MASTER_ADDR"] = options.master_addr;
      env["MASTER_PORT"] = std::to_string(master_port);
      // The job's token: every store connection proves it knows it (security/auth_token.h). One
      // given to the launcher (e.g. the same on every node) is passed on as it is.
      env[security::kTokenEnv] = token;
      // Workers start with SIGUSR1 ignored (worker_process.cpp); this tells init_process_group
      // that the ignore is the launcher's, not the program's, so the dump handler may replace it.
      env[comm::kSigusr1IgnoredEnv] = "1";
      env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(restart);
      env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(options.max_restarts);
      env["TORCHELASTIC_RUN_ID"] = options.run_id;
      // shoal run serves no agent store: ranks meet on the store rank 0 serves (init.cpp).
      env["TORCHELASTIC_USE_AGENT_STORE"] = "False";
      if (options.fault_tolerant) env[env::describe(env::Var::kFtAgentStore).name] = "1";
      if (base.count("OMP_NUM_THREADS") == 0) env["OMP_NUM_THREADS"] = "1";
      for (const auto& [name, value] : role.env) env[name] = value;

      WorkerSpec spec;
      spec.role = role.name;
      spec.rank = rank;
      spec.label = role.name == "worker" ? "rank " + std::to_string(rank)
                                         : role.name + " " + std::to_string(role_rank);
      spec.program = program;
      spec.argv = role.command;
      spec.error_file = error_root + "/attempt_" + std::to_string(restart) + "." +
                        std::to_string(local_rank) + ".json";
      if (!log_root.empty()) {
        // torchrun's layout: attempt_N/LOCAL_RANK/{stdout,stderr}.log (and its error file).
        const std::string dir = log_root + "/attempt_" + std::to_string(restart) + "/" +
                                std::to_string(local_rank);
        std::error_code error;
        std::filesystem::create_directories(dir, error);
        SHOAL_CHECK(!error, "cannot create the log directory ", dir, ": ", error.message());
        spec.error_file = dir + "/error.json";
        const int redirected = options.redirects.of(local_rank);
        const int teed = options.tee.of(local_rank);
        if ((redirected | teed) & 1) spec.stdout_file = dir + "/stdout.log";
        if ((redirected | teed) & 2) spec.stderr_file = dir + "/stderr.log";
        spec.stdout_to_console = !(redirected & 1) || (teed & 1);
        spec.stderr_to_console = !(redirected & 2) || (teed & 2);
      }
      env[log::kErrorFileEnv] = spec.error_file;
      for (const auto& [name, value] : env) spec.env.push_back(name + "=" + value);
      specs.push_back(std::move(spec));
    }
  }
  return specs;
}

void say(const LaunchOptions& options, const std::string& line) {
  log::info(options.log_name, ": ", line);
}

std::string plural(int n, const char* noun) {
  return std::to_string(n) + " " + noun + (n == 1 ? "" : "s");
}

std::string join_lines(const std::vector<std::string>& items) {
  std::string text;
  for (size_t i = 0; i < items.size(); ++i) text += (i ? "; " : "") + items[i];
  return text;
}

void report(const LaunchOptions& options, const GroupResult& result,
            const WorkerGroupOptions& group_options) {
  const double grace_s = group_options.grace_period.count() / 1000.0;
  char grace[32];
  std::snprintf(grace, sizeof(grace), "%g", grace_s);
  std::string line;
  switch (result.outcome) {
    case GroupResult::Outcome::kSucceeded:
      if (result.tolerated.empty() && result.replaced.empty()) return;
      line = "finished";
      if (!result.tolerated.empty()) {
        line += " without " + plural(static_cast<int>(result.tolerated.size()), "failed worker") +
                ": " + join_lines(result.tolerated);
      }
      if (!result.replaced.empty()) {
        line += std::string(result.tolerated.empty() ? "" : ";") + " after replacing " +
                plural(static_cast<int>(result.replaced.size()), "failed worker") + ": " +
                join_lines(result.replaced);
      }
      break;
    case GroupResult::Outcome::kWorkerFailed:
      line = (result.first_failed_label.empty()
                  ? std::string()
                  : result.first_failed_label + " (pid " + std::to_string(result.first_failed_pid) +
                        ") failed first (" + result.first_failed_error + "), then ") +
             result.failed_label + " (pid " + std::to_string(result.failed_pid) + ") " +
             result.failed_status.describe() + "; " +
             (result.stopped == 0   ? std::string("no other worker was running")
              : result.stopped == 1 ? std::string("stopped the other worker")
                                    : "stopped the other " + plural(result.stopped, "worker"));
      break;
    case GroupResult::Outcome::kInterrupted:
      line = "received " + signal_name(result.interrupt_signal) + "; forwarded it to " +
             plural(result.stopped, "worker");
      break;
  }
  if (result.killed > 0) {
    line += " (" + std::to_string(result.killed) + " still running " +
            (result.second_signal ? std::string("at a second signal")
                                  : "after the " + std::string(grace) + " s grace period") +
            ": killed)";
  }
  if (result.unreaped > 0) {
    line += "; " + plural(result.unreaped, "worker") + " did not die even after SIGKILL";
  }
  say(options, line);
}

}  // namespace

int StreamLogs::of(int local_rank) const {
  if (per_local_rank.empty()) return all;
  const auto found = per_local_rank.find(local_rank);
  return found == per_local_rank.end() ? 0 : found->second;
}

StreamLogs StreamLogs::parse(const std::string& text, const std::string& flag) {
  auto fail = [&]() {
    SHOAL_THROW(InvalidArgument, flag, " '", text, "' is not understood: give 0 (none), 1 (stdout), ",
                "2 (stderr) or 3 (both) for every local rank, or LOCAL_RANK:VALUE pairs such as "
                "0:3,1:1");
  };
  auto bits = [&](const std::string& digit) {
    if (digit.size() != 1 || digit[0] < '0' || digit[0] > '3') fail();
    return digit[0] - '0';
  };
  StreamLogs logs;
  if (text.find(':') == std::string::npos) {
    logs.all = bits(text);
    return logs;
  }
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    const std::string pair = text.substr(start, end - start);
    const size_t colon = pair.find(':');
    if (colon == std::string::npos || colon == 0) fail();
    for (size_t i = 0; i < colon; ++i) {
      if (pair[i] < '0' || pair[i] > '9') fail();
    }
    if (colon > 6) fail();
    logs.per_local_rank[std::stoi(pair.substr(0, colon))] = bits(pair.substr(colon + 1));
    start = end + 1;
  }
  return logs;
}

LaunchOptions LaunchOptions::workers(int nproc_per_node, std::vector<std::string> command) {
  LaunchOptions options;
  RoleSpec role;
  role.nproc_per_node = nproc_per_node;
  role.command = std::move(command);
  options.roles.push_back(std::move(role));
  return options;
}

LaunchOptions LaunchOptions::parameter_server(int workers, int servers,
                                              std::vector<std::string> command, int nnodes) {
  LaunchOptions options = LaunchOptions::workers(workers, std::move(command));
  options.nnodes = nnodes;
  RoleSpec server_role = options.roles.front();
  server_role.name = "server";
  server_role.nproc_per_node = servers;
  options.roles.push_back(std::move(server_role));
  for (RoleSpec& role : options.roles) {
    role.env.emplace_back("SHOAL_PS_NUM_SERVERS", std::to_string(servers * nnodes));
    role.env.emplace_back("SHOAL_PS_NUM_WORKERS", std::to_string(workers * nnodes));
  }
  return options;
}

std::string self_executable() {
  std::error_code error;
  const auto path = std::filesystem::read_symlink("/proc/self/exe", error);
  SHOAL_CHECK(!error, "cannot find this program's path (/proc/self/exe): ", error.message());
  return path.string();
}

int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

int pick_free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  SHOAL_CHECK(fd >= 0, "cannot pick a free port: socket: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  socklen_t length = sizeof(addr);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length) == 0;
  const int error = errno;
  ::close(fd);
  SHOAL_CHECK(ok, "cannot pick a free port: ", std::strerror(error),
              "; give one with --master-port");
  return ntohs(addr.sin_port);
}

bool is_loopback_address(const std::string& host) {
  if (host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1") return true;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0 || found == nullptr) return false;
  bool all_loopback = true;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
      all_loopback &= (ntohl(in->sin_addr.s_addr) >> 24) == 127;
    } else if (a->ai_family == AF_INET6) {
      const auto* in6 = reinterpret_cast<const sockaddr_in6*>(a->ai_addr);
      all_loopback &= IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr) != 0;
    }
  }
  ::freeaddrinfo(found);
  return all_loopback;
}

namespace {

// Fault tolerance: node 0's launcher serves the job's store, so that it outlives every worker.
// The token the server checks is the one plan_workers() hands the workers.
std::unique_ptr<comm::TcpStoreServer> serve_job_store(const LaunchOptions& options, int port) {
  if (!options.fault_tolerant || options.node_rank != 0) return nullptr;
  if (security::token_from_env().empty()) {
    ::setenv(security::kTokenEnv, security::generate_token().c_str(), 1);
  }
  return std::make_unique<comm::TcpStoreServer>(options.master_addr, port,
                                                security::token_from_env());
}

// Elastic membership: node 0's store lives for the whole launch (the rendezvous and every
// replacement's admission are in it), and this node learns whether it starts the job or joins it.
struct ElasticJob {
  std::unique_ptr<comm::TcpStoreServer> server;  // node 0's
  std::shared_ptr<comm::Store> store;
};

ElasticJob meet_elastic_job(const LaunchOptions& options, int master_port, int local_size) {
  ElasticJob job;
  if (!elastic(options)) return job;
  check_token(options);
  job.server = serve_job_store(options, master_port);
  job.store = comm::make_tcp_store(options.master_addr, master_port, 1, false,
                                   options.rdzv_join_timeout);
  ElasticRound round;
  round.min_nodes = options.min_nnodes;
  round.max_nodes = options.nnodes;
  round.node_rank = options.node_rank;
  round.local_size = local_size;
  round.join_timeout = options.rdzv_join_timeout;
  round.last_call = options.rdzv_last_call;
  meet_elastic(*job.store, round);
  // The meeting may wait join_timeout; the exit marks and the leaving after it must not, or an
  // unreachable node 0 holds this node's exit that long per request.
  job.store->set_timeout(comm::kDefaultTimeout);
  return job;
}

// Node 0 keeps the store up for the other nodes' workers; the others count themselves out.
void end_elastic_job(const LaunchOptions& options, const ElasticJob& job, int local_size) {
  if (options.node_rank == 0) {
    outlive_other_nodes(*job.store, options.nnodes * local_size);
    return;
  }
  try {
    leave_elastic(*job.store);
  } catch (const Error&) {
    // Node 0's store is gone with the job: no one is left to tell.
  }
}

}  // namespace

int launch(const LaunchOptions& options) {
  validate(options);
  int master_port = options.master_port != 0 ? options.master_port : pick_free_port();

  int local_size = 0;
  for (const RoleSpec& role : options.roles) local_size += role.nproc_per_node;
  if (options.verbose && local_size > 1 && std::getenv("OMP_NUM_THREADS") == nullptr) {
    say(options, "setting OMP_NUM_THREADS=1 for each worker so that " + std::to_string(local_size) +
                     " workers do not oversubscribe the cores; set OMP_NUM_THREADS to choose");
  }

  // --redirects / --tee: one folder per launch, as torchrun makes (RUN_ID_XXXXXX).
  std::string log_root;
  if (options.redirects.any() || options.tee.any()) {
    std::string parent = options.log_dir;
    if (parent.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      parent = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
    }
    std::error_code error;
    std::filesystem::create_directories(parent, error);
    SHOAL_CHECK_T(InvalidArgument, !error, "--log-dir ", parent, " cannot be created: ",
                  error.message());
    std::string pattern = parent + "/" + options.run_id + "_XXXXXX";
    SHOAL_CHECK_T(InvalidArgument, ::mkdtemp(pattern.data()) != nullptr, "--log-dir ", parent,
                  ": cannot create a folder in it: ", std::strerror(errno));
    log_root = pattern;
    say(options, "worker logs in " + log_root);
  }

  // The workers' error files (log/error_file.h), in the log folder when there is one, else in a
  // folder of this launch's own that goes with it.
  std::optional<checkpoint::detail::TempDir> errors;
  if (log_root.empty()) errors.emplace("shoal-errors-", "the workers' error files");
  const std::string error_root = errors ? errors->path() : log_root;

  WorkerGroupOptions group_options;
  group_options.prefix_output = options.prefix_output;
  group_options.grace_period = options.grace_period;
  group_options.tolerate_worker_failures =
      options.tolerate_worker_failures || options.fault_tolerant;
  group_options.replicas_finish_together = options.fault_tolerant;
  group_options.log_name = options.log_name;
  const ElasticJob elastic_job = meet_elastic_job(options, master_port, local_size);
  int replaced = 0;  // workers started again on their own, out of --max-restarts
  for (int restart = 0;; ++restart) {
    GroupResult result;
    // Fault tolerance: a failed worker is started again alone and rejoins the others. Only on
    // node 0, whose launcher counts exits in the store it serves, and on every node of an
    // elastic job, whose launchers all count them there: elsewhere a replacement could not tell
    // it is one.
    if (options.fault_tolerant && (options.node_rank == 0 || elastic_job.store)) {
      group_options.replace_failed_workers = options.max_restarts - restart - replaced;
    }
    {
      const auto job_store = elastic_job.store ? nullptr : serve_job_store(options, master_port);
      // The survivors' quorum waits for each member's vote or its death: the exit is told at once.
      std::shared_ptr<comm::Store> marks = elastic_job.store;
      if (job_store) marks = comm::make_tcp_store(options.master_addr, master_port, 1, false);
      group_options.on_exit = [marks](int rank) {
        if (marks) marks->add(parallel::FaultTolerantManager::exit_key(rank), 1);
      };
      SignalRelay relay;
      WorkerGroup group(plan_workers(options, master_port, restart, log_root, error_root),
                        group_options);
      result = group.run(relay);
      // Shared-memory names a worker made but could not remove (killed while its group formed).
      comm::shm::SharedSegment::remove_segments_of(group.pids());
    }
    report(options, result, group_options);
    replaced += static_cast<int>(result.replaced.size());
    // An elastic node whose workers failed beyond their replacements leaves the job; its
    // shoal run started again joins the job anew. (Restarting every node's workers at once is
    // the fixed-membership model.)
    if (elastic_job.store) {
      end_elastic_job(options, elastic_job, local_size);
      return result.exit_code;
    }
    if (result.outcome != GroupResult::Outcome::kWorkerFailed) return result.exit_code;
    if (restart + replaced >= options.max_restarts) {
      if (options.max_restarts > 0) {
        say(options, "restarts ran out: the job failed in all " + std::to_string(restart + 1) +
                         " attempts (--max-restarts " + std::to_string(options.max_restarts) +
                         "); exiting with the last failure's status " +
                         std::to_string(result.exit_code));
      }
      return result.exit_code;
    }
    // torchrun's elastic restart: every worker again, same ranks; programs read
    // TORCHELASTIC_RESTART_COUNT and resume from their last checkpoint.
    say(options, "restarting all " + plural(local_size, "worker") + " (restart " + std::to_string(restart + 1) +
                     " of at most " + std::to_string(options.max_restarts) + ")");
    if (options.master_port == 0) master_port = pick_free_port();
  }
}

int restart_count() {
  return static_cast<int>(env::integer(env::Var::kRestartCount).value_or(0));
}

}  // namespace shoal::launcher
