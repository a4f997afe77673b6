// `shoal run`: starts N worker processes of a program with the torchrun environment
// (torchrun's counterpart); a thin command line over shoal::launcher::launch().
#include <cmath>
#include <memory>

#include "commands.h"
#include "shoal/error.h"
#include "shoal/launcher/launch.h"

namespace shoal::cli {
namespace {

struct RunArgs {
  int nproc_per_node = 1;
  int num_servers = 0;
  bool tolerate_worker_failures = false;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool no_prefix = false;
  double grace_period_s = 5;
  int max_restarts = 0;
  std::vector<std::string> command;
};

}  // namespace

void add_run_command(CLI::App& root, std::vector<Command>& commands) {
  auto args = std::make_shared<RunArgs>();
  auto* app = root.add_subcommand(
      "run",
      "Start N processes of PROGRAM with the torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE,\n"
      "LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT); everything after PROGRAM goes to it.\n"
      "When one worker fails the others are stopped and shoal run exits with its status.");
  app->add_option("--nproc-per-node,--nproc_per_node", args->nproc_per_node,
                  "worker processes on this node")
      ->capture_default_str();
  app->add_option("--num-servers,--num_servers", args->num_servers,
                  "parameter-server processes on this node (ROLE_NAME=server; the workers get\n"
                  "ROLE_NAME=worker); both roles get SHOAL_PS_NUM_SERVERS and SHOAL_PS_NUM_WORKERS")
      ->check(CLI::Range(0, 1024))
      ->capture_default_str();
  app->add_flag("--tolerate-worker-failures", args->tolerate_worker_failures,
                "a failed worker does not stop the others (parameter server under asp/ssp); a\n"
                "failed server still stops the job");
  app->add_option("--nnodes", args->nnodes, "number of nodes of the job")->capture_default_str();
  app->add_option("--node-rank,--node_rank", args->node_rank, "this node's index, 0..nnodes-1")
      ->capture_default_str();
  app->add_option("--master-addr,--master_addr", args->master_addr,
                  "address of node 0, where rank 0 listens for the rendezvous")
      ->capture_default_str();
  app->add_option("--master-port,--master_port", args->master_port,
                  "port of the rendezvous; 0 picks a free one (single node only)")
      ->capture_default_str();
  app->add_flag("--no-prefix", args->no_prefix,
                "do not prefix worker output lines with \"[rank N] \"");
  app->add_option("--grace-period", args->grace_period_s,
                  "seconds the other workers get after SIGTERM (when one failed) before SIGKILL")
      ->capture_default_str();
  app->add_option("--max-restarts,--max_restarts", args->max_restarts,
                  "when a worker fails, restart all workers up to this many times (they see "
                  "TORCHELASTIC_RESTART_COUNT and resume from their last checkpoint)")
      ->capture_default_str();
  app->footer(
      "Example: shoal run --nproc-per-node 2 ./train --epochs 3\n"
      "         shoal run --nproc-per-node 2 --num-servers 1 ./ps_train   (parameter server)");
  // PROGRAM is the first positional word; it and every word after it (options included) are
  // the command. Extras are allowed so that "--" and unknown options reach the check below.
  app->add_option("command", args->command, "PROGRAM [ARGS...]");
  app->positionals_at_end();
  app->allow_extras();

  commands.push_back({app, [app, args] {
                        for (const auto& word : app->remaining()) {
                          SHOAL_CHECK_T(InvalidArgument, word == "--", "shoal run: unknown option '",
                                        word, "' (see shoal run --help)");
                        }
                        std::vector<std::string> command = args->command;
                        auto options =
                            args->num_servers > 0
                                ? launcher::LaunchOptions::parameter_server(
                                      args->nproc_per_node, args->num_servers, std::move(command),
                                      args->nnodes)
                                : launcher::LaunchOptions::workers(args->nproc_per_node,
                                                                   std::move(command));
                        options.nnodes = args->nnodes;
                        options.node_rank = args->node_rank;
                        options.master_addr = args->master_addr;
                        options.master_port = args->master_port;
                        options.prefix_output = !args->no_prefix;
                        options.max_restarts = args->max_restarts;
                        options.tolerate_worker_failures = args->tolerate_worker_failures;
                        SHOAL_CHECK_T(InvalidArgument,
                                      std::isfinite(args->grace_period_s) &&
                                          args->grace_period_s >= 0,
                                      "--grace-period must be a number of seconds >= 0");
                        options.grace_period = std::chrono::milliseconds(
                            static_cast<long long>(args->grace_period_s * 1000));
                        return launcher::launch(options);
                      }});
}

}  // namespace shoal::cli
