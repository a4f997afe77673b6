// `shoal run`: starts N worker processes of a program with the torchrun environment
// (torchrun's counterpart); a thin command line over shoal::launcher::launch().
#include <sched.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <sstream>
#include <thread>

#include "commands.h"
#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "shoal/launcher/launch.h"

namespace shoal::cli {
namespace {

struct RunArgs {
  std::string nproc_per_node = "1";
  int num_servers = 0;
  bool tolerate_worker_failures = false;
  bool fault_tolerant = false;
  std::string nnodes = "1";
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool no_prefix = false;
  double grace_period_s = 5;
  int max_restarts = 0;
  // torchrun's rendezvous and agent flags
  bool standalone = false;
  std::string rdzv_backend = "static";
  std::string rdzv_endpoint;
  std::string rdzv_id = "none";
  std::string rdzv_conf;
  double monitor_interval_s = 5;
  std::string start_method = "spawn";
  std::string role;
  bool no_python = false;
  bool module = false;
  bool run_path = false;
  std::string log_dir;
  std::string redirects = "0";
  std::string tee = "0";
  std::vector<std::string> command;
  // Flags whose presence matters under srun (SLURM's values fill in those not given).
  CLI::Option* nnodes_flag = nullptr;
  CLI::Option* node_rank_flag = nullptr;
  CLI::Option* master_addr_flag = nullptr;
  CLI::Option* master_port_flag = nullptr;
};

/// Where the job's nodes meet: how many, which one this is, rank 0's address, the job's id.
struct Rendezvous {
  int nodes = 1;
  int min_nodes = 1;  // below nodes: an elastic range
  int node_rank = 0;
  std::string addr;
  int port = 0;
  std::string run_id;
};

// Why 29400: torchrun's default port for a c10d rendezvous endpoint given without one.
constexpr int kDefaultRdzvPort = 29400;

int parse_port(const std::string& text, const std::string& what) {
  char* end = nullptr;
  const long port = std::strtol(text.c_str(), &end, 10);
  SHOAL_CHECK_T(InvalidArgument, !text.empty() && *end == '\0' && port >= 0 && port <= 65535,
                what, ": '", text, "' is not a TCP port (0..65535)");
  return static_cast<int>(port);
}

/// A host name or address for MASTER_ADDR: what torchrun accepts in an endpoint (letters, digits,
/// '_', '.', ':', '-'), so that an endpoint without a host (":29400") is refused as torchrun
/// refuses it, rather than handing every worker an empty MASTER_ADDR.
void check_host(const std::string& host, const std::string& flag, const std::string& given) {
  const bool valid = !host.empty() && std::all_of(host.begin(), host.end(), [](unsigned char c) {
    return std::isalnum(c) || c == '_' || c == '.' || c == ':' || c == '-';
  });
  SHOAL_CHECK_T(InvalidArgument, valid, "shoal run: ", flag, " '", given, "' has ",
                host.empty() ? "no host" : "a host that is not a name or an address",
                ": give node 0's host name or address", flag == "--rdzv-endpoint" ? " as HOST[:PORT]" : "",
                " (torchrun refuses it too)");
}

/// --nnodes N or MIN:MAX (an elastic range; launch() refuses it without --fault-tolerant).
struct NodeRange {
  int min = 1;
  int max = 1;
};

NodeRange parse_nnodes(const std::string& text) {
  const size_t colon = text.find(':');
  auto number = [&](const std::string& part) {
    char* end = nullptr;
    const long n = std::strtol(part.c_str(), &end, 10);
    SHOAL_CHECK_T(InvalidArgument, !part.empty() && *end == '\0' && n >= 1 && n <= 65536,
                  "--nnodes '", text, "' is not understood: give N or MIN:MAX, numbers >= 1");
    return static_cast<int>(n);
  };
  if (colon == std::string::npos) return {number(text), number(text)};
  return {number(text.substr(0, colon)), number(text.substr(colon + 1))};
}

/// torchrun's --rdzv-conf KEY=VALUE,...: the elastic round's join_timeout and last_call_timeout
/// (seconds).
void parse_rdzv_conf(const std::string& text, launcher::LaunchOptions& options) {
  std::istringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq);
    const std::string value = eq == std::string::npos ? "" : item.substr(eq + 1);
    char* end = nullptr;
    const double seconds = std::strtod(value.c_str(), &end);
    SHOAL_CHECK_T(InvalidArgument,
                  (key == "join_timeout" || key == "last_call_timeout") && !value.empty() &&
                      *end == '\0' && std::isfinite(seconds) && seconds >= 0,
                  "--rdzv-conf '", item, "' is not understood: give join_timeout=SECONDS and/or "
                  "last_call_timeout=SECONDS (the elastic round of --nnodes MIN:MAX)");
    // Why a bound: a week is beyond any real rendezvous, and it keeps seconds * 1000 within
    // long long.
    constexpr double kMaxSeconds = 7 * 24 * 3600;
    SHOAL_CHECK_T(InvalidArgument, seconds <= kMaxSeconds, "--rdzv-conf '", item,
                  "': at most ", static_cast<long long>(kMaxSeconds), " seconds (7 days)");
    const std::chrono::milliseconds ms(static_cast<long long>(seconds * 1000));
    (key == "join_timeout" ? options.rdzv_join_timeout : options.rdzv_last_call) = ms;
  }
}

/// --nproc-per-node N | auto | cpu | gpu, as torchrun counts them (cpu: the cores this process
/// may use, its affinity mask, where torchrun takes os.cpu_count()).
int parse_nproc_per_node(const std::string& text) {
  if (text == "cpu") return launcher::available_cores();
  const int gpus = static_cast<int>(torch::cuda::device_count());
  if (text == "gpu") {
    SHOAL_CHECK_T(InvalidArgument, gpus > 0, "--nproc-per-node gpu: no CUDA GPU is visible (",
                  "this Shoal's LibTorch ", torch::cuda::is_available() ? "sees none" : "has no CUDA",
                  "); give a number, or cpu");
    return gpus;
  }
  if (text == "auto") return gpus > 0 ? gpus : launcher::available_cores();
  char* end = nullptr;
  const long n = std::strtol(text.c_str(), &end, 10);
  SHOAL_CHECK_T(InvalidArgument, !text.empty() && *end == '\0' && n >= 1 && n <= 65536,
                "--nproc-per-node '", text, "' is not understood: give a number, auto, cpu or gpu");
  return static_cast<int>(n);
}

/// A fresh job id for --standalone, as torchrun makes one (a random UUID).
std::string random_run_id() {
  std::random_device device;
  std::mt19937_64 generator((static_cast<uint64_t>(device()) << 32) ^ device());
  const uint64_t high = generator();
  const uint64_t low = generator();
  char text[40];
  std::snprintf(text, sizeof(text), "%08x-%04x-4%03x-%04x-%012llx",
                static_cast<unsigned>(high >> 32), static_cast<unsigned>((high >> 16) & 0xffff),
                static_cast<unsigned>(high & 0xfff),
                static_cast<unsigned>(0x8000 | ((low >> 48) & 0x3fff)),
                static_cast<unsigned long long>(low & 0xffffffffffffULL));
  return text;
}

/// How many processes, on how many nodes, and where node 0 is.
void add_process_flags(CLI::App& app, RunArgs& args) {
  app.add_option("--nproc-per-node,--nproc_per_node", args.nproc_per_node,
                 "worker processes on this node: N, auto (GPUs, else CPUs), cpu or gpu")
      ->capture_default_str();
  app.add_option("--num-servers,--num_servers", args.num_servers,
                 "parameter-server processes on this node (ROLE_NAME=server; the workers get\n"
                 "ROLE_NAME=worker); both roles get SHOAL_PS_NUM_SERVERS and SHOAL_PS_NUM_WORKERS")
      ->check(CLI::Range(0, 1024))
      ->capture_default_str();
  app.add_flag("--tolerate-worker-failures", args.tolerate_worker_failures,
               "a failed worker does not stop the others (parameter server under asp/ssp); a\n"
               "failed server still stops the job");
  app.add_flag("--fault-tolerant", args.fault_tolerant,
               "for `shoal train --fault-tolerant`: this launcher serves the job's store and a\n"
               "failed worker does not stop the others (on when the worker's arguments have\n"
               "--fault-tolerant)");
  args.nnodes_flag = app.add_option("--nnodes", args.nnodes,
                                    "number of nodes of the job: N, or MIN:MAX (elastic, with\n"
                                    "--fault-tolerant: starts once MIN nodes met, nodes join and\n"
                                    "leave the running job; give each node its --node-rank)")
      ->capture_default_str();
  args.node_rank_flag = app.add_option("--node-rank,--node_rank", args.node_rank,
                                       "this node's index, 0..nnodes-1")
      ->capture_default_str();
  args.master_addr_flag = app.add_option("--master-addr,--master_addr", args.master_addr,
                                         "address of node 0, where rank 0 listens for the rendezvous")
      ->capture_default_str();
  args.master_port_flag = app.add_option("--master-port,--master_port", args.master_port,
                                         "port of the rendezvous; 0 picks a free one (single node only)")
      ->capture_default_str();
}

/// torchrun's rendezvous and agent flags, accepted with its spellings.
void add_torchrun_flags(CLI::App& app, RunArgs& args) {
  app.add_flag("--standalone", args.standalone,
               "one node, a rendezvous on a free local port and a random --rdzv-id (torchrun's)");
  app.add_option("--rdzv-backend,--rdzv_backend", args.rdzv_backend,
                 "static (the master is --master-addr:--master-port) or c10d (the master is\n"
                 "--rdzv-endpoint); node ranks are static either way (give --node-rank)")
      ->check(CLI::IsMember({"static", "c10d"}))
      ->capture_default_str();
  app.add_option("--rdzv-endpoint,--rdzv_endpoint", args.rdzv_endpoint,
                 "HOST[:PORT] where rank 0 serves the rendezvous (port default 29400)");
  app.add_option("--rdzv-id,--rdzv_id", args.rdzv_id,
                 "the job's id, given to the workers as TORCHELASTIC_RUN_ID")
      ->capture_default_str();
  app.add_option("--rdzv-conf,--rdzv_conf", args.rdzv_conf,
                 "join_timeout=S,last_call_timeout=S: how long node 0 waits for --nnodes MIN\n"
                 "(default 600 s) and then for more nodes up to MAX (default 30 s); at most\n"
                 "7 days each")
      ->type_name("KEY=VALUE,...");
  app.add_option("--monitor-interval,--monitor_interval", args.monitor_interval_s,
                 "seconds between torchrun's checks of its workers; accepted, and needless here:\n"
                 "shoal run sees a worker's exit at once (SIGCHLD)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--start-method,--start_method", args.start_method,
                 "Python's multiprocessing start method; accepted and ignored (a worker that is\n"
                 "this shoal program starts by fork alone, any other by fork+exec;\n"
                 "SHOAL_LAUNCH_EXEC=1 execs every worker)")
      ->check(CLI::IsMember({"spawn", "fork", "forkserver"}))
      ->capture_default_str();
  app.add_option("--role", args.role, "ROLE_NAME given to the workers (default worker)");
  app.add_flag("--no-python,--no_python", args.no_python,
               "accepted: PROGRAM is always run as it is (shoal run never prepends python)");
  app.add_flag("-m,--module", args.module, "refused: run python -m MODULE as PROGRAM instead");
  app.add_flag("--run-path,--run_path", args.run_path, "refused: give the program to run");
  app.add_option("--log-dir,--log_dir", args.log_dir,
                 "where --redirects and --tee write the workers' logs:\n"
                 "DIR/RDZV_ID_XXXXXX/attempt_N/LOCAL_RANK/{stdout,stderr}.log")
      ->type_name("DIR");
  app.add_option("-r,--redirects", args.redirects,
                 "streams written to the log file instead of the console: 0 none, 1 stdout,\n"
                 "2 stderr, 3 both, or per local rank (0:3,1:0)")
      ->capture_default_str();
  app.add_option("-t,--tee", args.tee,
                 "streams written to the log file and to the console (same values as --redirects)")
      ->capture_default_str();
}

/// How the workers' output is shown, and how failures are handled.
void add_output_flags(CLI::App& app, RunArgs& args) {
  app.add_flag("--no-prefix", args.no_prefix,
               "do not prefix worker output lines with \"[rank N] \"");
  app.add_option("--grace-period", args.grace_period_s,
                 "seconds the other workers get after SIGTERM (when one failed) before SIGKILL")
      ->capture_default_str();
  app.add_option("--max-restarts,--max_restarts", args.max_restarts,
                 "when a worker fails, restart all workers up to this many times (they see "
                 "TORCHELASTIC_RESTART_COUNT and resume from their last checkpoint); with "
                 "--fault-tolerant, restart the failed worker alone, which rejoins the others")
      ->capture_default_str();
}

/// Refuses the words shoal run cannot run: unknown options, and torchrun's Python-only modes.
void check_command(const CLI::App& app, const RunArgs& args) {
  for (const auto& word : app.remaining()) {
    SHOAL_CHECK_T(InvalidArgument, word == "--", "shoal run: unknown option '", word,
                  "' (see shoal run --help)");
  }
  SHOAL_CHECK_T(InvalidArgument, !args.module,
                "shoal run: -m/--module runs Python modules, which shoal run does not do: give "
                "`python3 -m MODULE` as the program");
  SHOAL_CHECK_T(InvalidArgument, !args.run_path,
                "shoal run: --run-path runs a script inside torchrun's own Python, which shoal run "
                "does not have: give the program");
}

/// --rdzv-endpoint HOST[:PORT] (c10d): node 0's address and port.
void use_rdzv_endpoint(const RunArgs& args, Rendezvous& rdzv) {
  SHOAL_CHECK_T(InvalidArgument, !args.rdzv_endpoint.empty(),
                "shoal run: --rdzv-backend c10d needs --rdzv-endpoint HOST[:PORT] (node 0's address)");
  const std::string& endpoint = args.rdzv_endpoint;
  const size_t colon = endpoint.rfind(':');
  const bool has_port = colon != std::string::npos && endpoint.find(':') == colon;  // not IPv6
  rdzv.addr = has_port ? endpoint.substr(0, colon) : endpoint;
  if (rdzv.addr.size() > 2 && rdzv.addr.front() == '[' && rdzv.addr.back() == ']') {
    rdzv.addr = rdzv.addr.substr(1, rdzv.addr.size() - 2);
  }
  check_host(rdzv.addr, "--rdzv-endpoint", endpoint);
  rdzv.port = has_port ? parse_port(endpoint.substr(colon + 1), "--rdzv-endpoint") : kDefaultRdzvPort;
  SHOAL_CHECK_T(InvalidArgument, rdzv.nodes == 1 || args.node_rank_flag->count() > 0,
                "shoal run: --rdzv-backend c10d across ", rdzv.nodes,
                " nodes: shoal run assigns node ranks statically, so give each node its --node-rank "
                "(0..", rdzv.nodes - 1, ")");
}

/// One shoal run per node under srun: the job's shape comes from SLURM, where no flag gave it.
void use_slurm(const RunArgs& args, Rendezvous& rdzv) {
  const comm::RankInfo slurm = comm::detect_rank_info();
  if (slurm.source != "slurm" || !slurm.launched) return;
  if (args.nnodes_flag->count() == 0) rdzv.nodes = rdzv.min_nodes = slurm.world_size;
  if (args.node_rank_flag->count() == 0) rdzv.node_rank = slurm.rank;
  const bool own_master = !args.standalone && args.rdzv_endpoint.empty();
  if (args.master_addr_flag->count() == 0 && own_master) rdzv.addr = slurm.master_addr;
  if (args.master_port_flag->count() == 0 && own_master) rdzv.port = slurm.master_port;
  if (args.rdzv_id == "none") {
    rdzv.run_id = std::getenv("SLURM_JOB_ID") ? std::getenv("SLURM_JOB_ID") : "none";
  }
}

/// The rendezvous the flags (and SLURM) describe.
Rendezvous find_rendezvous(const RunArgs& args) {
  const NodeRange range = parse_nnodes(args.nnodes);
  Rendezvous rdzv{range.max, range.min, args.node_rank, args.master_addr, args.master_port,
                  args.rdzv_id};
  check_host(rdzv.addr, "--master-addr", rdzv.addr);
  if (args.standalone) {
    // torchrun --standalone: one node, a free local port, a random id.
    SHOAL_CHECK_T(InvalidArgument, rdzv.nodes == 1, "shoal run: --standalone ",
                  "is one node; drop --nnodes ", args.nnodes);
    rdzv.addr = "localhost";
    rdzv.port = 0;
    rdzv.run_id = random_run_id();
  } else if (args.rdzv_backend == "c10d" || !args.rdzv_endpoint.empty()) {
    use_rdzv_endpoint(args, rdzv);
  }
  use_slurm(args, rdzv);
  return rdzv;
}

/// The launcher's options: the job's roles and processes, its rendezvous, its output.
launcher::LaunchOptions launch_options(const RunArgs& args, int nproc_per_node,
                                       const Rendezvous& rdzv) {
  auto options = args.num_servers > 0
                     ? launcher::LaunchOptions::parameter_server(nproc_per_node, args.num_servers,
                                                                 args.command, rdzv.nodes)
                     : launcher::LaunchOptions::workers(nproc_per_node, args.command);
  if (!args.role.empty()) {
    SHOAL_CHECK_T(InvalidArgument, args.num_servers == 0,
                  "shoal run: --role names the workers of a plain job; a parameter-server job's "
                  "roles are worker and server");
    options.roles.front().env.emplace_back("ROLE_NAME", args.role);
  }
  options.nnodes = rdzv.nodes;
  options.min_nnodes = rdzv.min_nodes;
  parse_rdzv_conf(args.rdzv_conf, options);
  options.node_rank = rdzv.node_rank;
  options.master_addr = rdzv.addr;
  options.master_port = rdzv.port;
  options.run_id = rdzv.run_id;
  options.prefix_output = !args.no_prefix;
  options.max_restarts = args.max_restarts;
  options.tolerate_worker_failures = args.tolerate_worker_failures;
  options.fault_tolerant = args.fault_tolerant;
  for (const auto& role : options.roles) {
    for (const auto& arg : role.command) options.fault_tolerant |= arg == "--fault-tolerant";
  }
  options.log_dir = args.log_dir;
  options.redirects = launcher::StreamLogs::parse(args.redirects, "--redirects");
  options.tee = launcher::StreamLogs::parse(args.tee, "--tee");
  SHOAL_CHECK_T(InvalidArgument, std::isfinite(args.grace_period_s) && args.grace_period_s >= 0,
                "--grace-period must be a number of seconds >= 0");
  options.grace_period =
      std::chrono::milliseconds(static_cast<long long>(args.grace_period_s * 1000));
  return options;
}

/// `shoal run`: checks the command, finds the rendezvous and launches the job.
int run_job(const CLI::App& app, const RunArgs& args) {
  check_command(app, args);
  const int nproc_per_node = parse_nproc_per_node(args.nproc_per_node);
  const launcher::LaunchOptions options =
      launch_options(args, nproc_per_node, find_rendezvous(args));
  return launcher::launch(options);
}

}  // namespace

void add_run_command(CLI::App& root, std::vector<Command>& commands) {
  auto args = std::make_shared<RunArgs>();
  auto* app = root.add_subcommand(
      "run",
      "Start N processes of PROGRAM with the torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE,\n"
      "LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT); everything after PROGRAM goes to it.\n"
      "When one worker fails the others are stopped and shoal run exits with its status.\n"
      "torchrun's flags are accepted, with its underscore spellings (docs/GUIDE.md has the table).\n"
      "Under srun (one shoal run per node), --nnodes, --node-rank and the master come from SLURM.");
  add_process_flags(*app, *args);
  add_torchrun_flags(*app, *args);
  add_output_flags(*app, *args);
  app->footer(
      "Example: shoal run --nproc-per-node 2 ./train --epochs 3\n"
      "         shoal run --standalone --nproc-per-node auto ./train\n"
      "         shoal run --nnodes 2 --node-rank 0 --rdzv-backend c10d --rdzv-endpoint node0:29400 ./train\n"
      "         shoal run --nproc-per-node 2 --num-servers 1 ./ps_train   (parameter server)");
  // PROGRAM is the first positional word; it and every word after it (options included) are
  // the command. Extras are allowed so that "--" and unknown options reach the check below.
  app->add_option("command", args->command, "PROGRAM [ARGS...]");
  app->positionals_at_end();
  app->allow_extras();

  commands.push_back({app, [app, args] { return run_job(*app, *args); }});
}

}  // namespace shoal::cli
