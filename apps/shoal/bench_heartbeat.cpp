// `shoal bench heartbeat --ranks 256,1024,4096`: the heartbeat's store traffic and its verdicts as
// the job grows, on HeartbeatSimulation (every rank a real HangReporter with a TCP client of its
// own, in this process): requests per rank and second at rest (each rank in --groups groups, as
// under the hierarchical backend) and while every rank but rank 0 waits on it for --busy-s
// seconds (rank 0 busy, as when it writes a checkpoint, yet beating: no rank may be named), then
// how long until every waiter names a rank that stops beating. One process runs every rank's
// answering and waiting, one after another: at thousands of ranks a round of beats takes longer
// than on a real job, where each process beats for itself, so the figures are an upper bound.
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench_harness.h"
#include "bench_util.h"
#include "comm/heartbeat_simulation.h"
#include "comm/timeouts.h"
#include "commands.h"
#include "shoal/error.h"

namespace shoal::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct HeartbeatBenchArgs {
  std::vector<int> ranks{256, 1024};
  int groups = 3;
  double busy_s = 20;
  double rest_s = 5;
  bool json = false;
};

// Store requests per rank and second over the next `seconds`.
double request_rate(const comm::HeartbeatSimulation& job, double seconds) {
  const int64_t before = job.requests();
  const auto start = Clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  return (job.requests() - before) / (seconds_since(start) * job.ranks());
}

void bench_one(int ranks, const HeartbeatBenchArgs& args) {
  const auto built = Clock::now();
  comm::HeartbeatSimulation job(ranks, args.groups);
  const double connect_s = seconds_since(built);
  std::this_thread::sleep_for(std::chrono::seconds(2));  // every answering round has begun
  const double rest = request_rate(job, args.rest_s);
  job.start_waiting(0, 1, comm::silent_peer_timeout());
  const double waiting = request_rate(job, args.busy_s);
  const int false_alarms = job.naming();
  const int stopped = ranks / 2;
  job.stop(stopped);
  const auto stop_time = Clock::now();
  const auto limit = comm::silent_peer_timeout() * 4;
  while (job.naming() < ranks - 2 && Clock::now() - stop_time < limit) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const double named_after = seconds_since(stop_time);
  const int named = job.naming() - false_alarms;
  job.stop_waiting();
  ReportLine line;
  line.add("bench", "heartbeat").add("ranks", ranks).add("groups", args.groups)
      .add("connect_s", connect_s, 2).add("rest_requests_per_rank_s", rest, 3)
      .add("busy_s", args.busy_s, 1).add("waiting_requests_per_rank_s", waiting, 3)
      .add("false_alarms", false_alarms).add("stopped_rank", stopped)
      .add("waiters_naming_it", named).add("named_within_s", named_after, 2)
      .add("heartbeat_timeout_s", comm::silent_peer_timeout().count() / 1e3, 1);
  if (args.json) {
    line.print();
    return;
  }
  std::printf("%5d ranks x %d groups: at rest %.2f requests/rank/s; %d waiting on busy rank 0 for "
              "%.0f s: %.2f requests/rank/s, %d false alarms; rank %d stopped: named by %d of %d "
              "waiters within %.1f s (limit %.0f s)\n",
              ranks, args.groups, rest, ranks - 1, args.busy_s, waiting, false_alarms, stopped,
              named, ranks - 2, named_after, comm::silent_peer_timeout().count() / 1e3);
  std::fflush(stdout);
}

int bench_heartbeat(const HeartbeatBenchArgs& args) {
  SHOAL_CHECK_T(InvalidArgument, args.busy_s > 0 && args.rest_s > 0 && args.groups > 0,
                "bench heartbeat: --busy-s, --rest-s and --groups must be positive");
  for (int ranks : args.ranks) {
    SHOAL_CHECK_T(InvalidArgument, ranks >= 3 && ranks <= 65536,
                  "bench heartbeat: --ranks takes 3 to 65536, got ", ranks);
  }
  for (int ranks : args.ranks) bench_one(ranks, args);
  return 0;
}

}  // namespace

void add_bench_heartbeat_command(CLI::App& bench, std::vector<Command>& commands) {
  auto args = std::make_shared<HeartbeatBenchArgs>();
  auto* app = bench.add_subcommand(
      "heartbeat", "The heartbeat's store requests per rank at rest and while every rank waits on "
                   "a busy one, false alarms, and how fast a stopped rank is named, for simulated "
                   "jobs of --ranks ranks");
  app->add_option("--ranks", args->ranks, "simulated job sizes, e.g. 256,1024,4096")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--groups", args->groups, "groups each rank is in (3: the hierarchical backend's)")
      ->capture_default_str();
  app->add_option("--busy-s", args->busy_s, "seconds every rank waits on busy rank 0")
      ->capture_default_str();
  app->add_option("--rest-s", args->rest_s, "seconds measured at rest")->capture_default_str();
  app->add_flag("--json", args->json, "one JSON object per job size");
  commands.push_back({app, [args] { return bench_heartbeat(*args); }});
}

}  // namespace shoal::cli
