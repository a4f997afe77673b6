// `shoal bench rendezvous --ranks N[,N...]`: the control plane's start-up against the number of
// ranks. N simulated ranks (threads of this process, each with its own connection to a real TCP
// store server, as every rank of a job has) run the real code, phase by phase: connect (the
// authenticated handshake), rendezvous (init_process_group's membership check) and gather (the
// per-host records a shm or hierarchical group forms from). Each phase's wall time (first start to
// last finish) and the store requests the server counted, next to PyTorch's own TCPStore running
// c10d's pattern (each rank sets its key, then waits for every rank's: bench/rendezvous_torch.py).
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "bench_harness.h"
#include "bench_util.h"
#include "comm/peer_directory.h"
#include "comm/rendezvous.h"
#include "comm/tcp_store.h"
#include "comm/tcp_store_server.h"
#include "commands.h"
#include "shoal/error.h"

namespace shoal::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct RendezvousBenchArgs {
  std::vector<int> ranks{64, 256, 1024};
  std::vector<std::string> torch{"debian"};
  bool no_torch = false;
  int64_t timeout_s = 600;
  int64_t torch_timeout_s = 120;
};

constexpr const char* kPhases[] = {"connect", "rendezvous", "gather"};
constexpr int kPhaseCount = 3;

/// The ranks' threads run phase after phase; the bench thread starts each and times it.
class PhaseGate {
 public:
  explicit PhaseGate(int ranks) : ranks_(ranks) {}
  /// A rank: waits for `phase` to start.
  void await(int phase) {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return started_ >= phase; });
  }
  /// A rank: its part of the current phase is done.
  void done() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (++finished_ == ranks_) changed_.notify_all();
  }
  /// The bench thread: starts `phase` and returns its seconds once every rank is done.
  double run(int phase) {
    const auto start = Clock::now();
    std::unique_lock<std::mutex> lock(mutex_);
    finished_ = 0;
    started_ = phase;
    changed_.notify_all();
    changed_.wait(lock, [&] { return finished_ == ranks_; });
    return std::chrono::duration<double>(Clock::now() - start).count();
  }

 private:
  const int ranks_;
  std::mutex mutex_;
  std::condition_variable changed_;
  int started_ = -1;
  int finished_ = 0;
};

void raise_open_files(int ranks) {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  const rlim_t wanted = 2 * static_cast<rlim_t>(ranks) + 256;
  SHOAL_CHECK_T(InvalidArgument, limit.rlim_max == RLIM_INFINITY || limit.rlim_max >= wanted,
                "bench rendezvous: --ranks ", ranks, " needs ", wanted, " open files but the hard limit is ",
                limit.rlim_max, "; raise it (ulimit -Hn) or pass fewer ranks");
  if (limit.rlim_cur >= wanted) return;
  limit.rlim_cur = wanted;
  ::setrlimit(RLIMIT_NOFILE, &limit);
}

/// One rank's thread: every phase in turn; the first error is kept and the rest skipped.
void run_rank(int rank, int ranks, int port, comm::Milliseconds timeout, PhaseGate& gate, std::string& error) {
  std::unique_ptr<comm::TcpStore> store;
  for (int phase = 0; phase < kPhaseCount; ++phase) {
    gate.await(phase);
    try {
      if (!error.empty()) {
      } else if (phase == 0) {
        store = std::make_unique<comm::TcpStore>("127.0.0.1", port, false, "bench", timeout);
      } else if (phase == 1) {
        comm::rendezvous(*store, rank, ranks, timeout);
      } else {
        comm::gather_records(*store, "bench/host", rank, ranks, comm::local_hostname());
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
    gate.done();
  }
}

void bench_shoal(int ranks, comm::Milliseconds timeout) {
  raise_open_files(ranks);
  comm::TcpStore server("127.0.0.1", 0, true, "bench", timeout);
  PhaseGate gate(ranks);
  std::vector<std::string> errors(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] { run_rank(r, ranks, server.port(), timeout, gate, errors[r]); });
  }
  ReportLine line;
  line.add("bench", "rendezvous").add("contender", "shoal").add("ranks", ranks);
  double total_s = 0;
  uint64_t before = server.server()->total_requests();
  for (int phase = 0; phase < kPhaseCount; ++phase) {
    const double seconds = gate.run(phase);
    const uint64_t after = server.server()->total_requests();
    line.add(std::string(kPhases[phase]) + "_s", seconds, 3)
        .add(std::string(kPhases[phase]) + "_requests", static_cast<int64_t>(after - before));
    total_s += seconds;
    before = after;
  }
  for (auto& t : threads) t.join();
  const auto failed = std::find_if(errors.begin(), errors.end(), [](const std::string& e) { return !e.empty(); });
  SHOAL_CHECK(failed == errors.end(), "bench rendezvous: rank ", failed - errors.begin(), " of ", ranks,
              " failed: ", *failed);
  line.add("total_s", total_s, 3)
      .add("requests_per_rank", static_cast<double>(server.server()->total_requests()) / ranks, 2)
      .print();
}

void bench_torch(const TorchPeer& peer, int ranks, const RendezvousBenchArgs& args) {
  TempDir dir("rendezvous");
  ChildProcess child;
  child.argv = peer.python;
  for (const std::string& arg : {bench_script("rendezvous_torch.py"), std::string("--ranks"), std::to_string(ranks),
                                 std::string("--result"), dir.file("result.json"),
                                 std::string("--timeout"), std::to_string(args.torch_timeout_s)}) {
    child.argv.push_back(arg);
  }
  RunProcessesOptions options;
  options.benchmark = "bench rendezvous";
  options.run = "the PyTorch peer";
  options.deadline = std::chrono::seconds(args.torch_timeout_s);
  ReportLine line;
  line.add("bench", "rendezvous").add("contender", peer.label()).add("ranks", ranks);
  bool ok = false;
  try {
    ok = run_processes({child}, options) == 0;
  } catch (const TimeoutError&) {
    line.add("over_s", args.torch_timeout_s);  // c10d took longer than --torch-timeout
  }
  if (!ok) {
    line.add_null("connect_s").add_null("rendezvous_s").print();
    return;
  }
  const Values result = read_json_numbers(dir.file("result.json"));
  line.add("connect_s", result.at("connect_s"), 3).add("rendezvous_s", result.at("rendezvous_s"), 3).print();
}

int bench_rendezvous(const RendezvousBenchArgs& args) {
  const comm::Milliseconds timeout(args.timeout_s * 1000);
  std::vector<TorchPeer> peers;
  for (const auto& name : args.no_torch ? std::vector<std::string>() : args.torch) {
    TorchPeer peer = find_torch_peer(name, "bench rendezvous");
    if (peer.available()) peers.push_back(peer);
  }
  for (int ranks : args.ranks) {
    bench_shoal(ranks, timeout);
    for (const auto& peer : peers) bench_torch(peer, ranks, args);
  }
  return 0;
}

}  // namespace

void add_bench_rendezvous_command(CLI::App& bench, std::vector<Command>& commands) {
  auto args = std::make_shared<RendezvousBenchArgs>();
  auto* app = bench.add_subcommand(
      "rendezvous", "The store's start-up phases for N simulated ranks (threads): time and requests, vs c10d's");
  app->add_option("--ranks", args->ranks, "numbers of ranks, comma-separated (default 64,256,1024)")
      ->delimiter(',')
      ->check(CLI::Range(2, 8192));
  add_torch_option(*app, args->torch);
  app->add_flag("--no-torch", args->no_torch, "measure Shoal only");
  app->add_option("--timeout", args->timeout_s, "seconds each phase may take (default 600)")
      ->check(CLI::PositiveNumber);
  app->add_option("--torch-timeout", args->torch_timeout_s,
                  "seconds PyTorch's run may take per N before it is stopped and reported as null (default 120)")
      ->check(CLI::PositiveNumber);
  commands.push_back({app, [args] { return bench_rendezvous(*args); }});
}

}  // namespace shoal::cli
