// A parameter server: owns the key ranges workers send it, applies their gradients with its
// ShardOptimizer under the chosen consistency model, and answers pulls with the ranges that
// changed since the version the worker has.
//
// It listens on one ZeroMQ ROUTER socket (ServerOptions::bind, an ephemeral port by default; see
// endpoint()). With an auth token (SHOAL_AUTH_TOKEN by default) a connection must pass a gate in
// ZeroMQ's handshake (an HMAC of the token, checked before any message of it is read) and then
// answer an HMAC-SHA256 challenge before anything else is accepted (src/ps/auth.h). Malformed,
// truncated, oversized and unauthenticated messages are rejected, counted and logged to stderr
// (at most 10 lines a second); the server keeps serving the others.
//
// Faults: a worker that says nothing for worker_timeout while not waiting on the server is
// presumed dead. Under asp and ssp training goes on without it (it no longer holds back the
// clock; reported on stderr and in stats(); should it speak again it rejoins); under bsp the step
// cannot complete, so every waiting and later pull is answered with an error naming it.
//
// run() returns when every worker has said goodbye or is presumed dead, or after stop().
//
// Thread safety: run() on one thread (or start()); stop(), stats() and endpoint() from any.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "shoal/ps/consistency.h"
#include "shoal/ps/shard_optimizer.h"

namespace shoal::ps {

struct ServerOptions {
  /// This server's index among the job's servers (names it in messages).
  int rank = 0;
  /// Workers of the job (ranks 0..num_workers-1).
  int num_workers = 1;
  Consistency consistency = Consistency::kBsp;
  /// ssp's bound s, in clocks.
  int staleness = 0;
  /// ZeroMQ endpoint to bind; "*" as the port picks a free one.
  std::string bind = "tcp://127.0.0.1:*";
  /// Shared token peers must prove they know; empty = no authentication. Defaults to
  /// $SHOAL_AUTH_TOKEN.
  std::string auth_token;
  bool auth_token_from_env = true;
  /// The update rule; SGD with lr 0.01 when null. The server steps its own clone(), so servers
  /// started from one ServerOptions never share optimizer state (nor race on it).
  std::shared_ptr<ShardOptimizer> optimizer;
  /// A worker silent this long while not waiting on the server is presumed dead. Why 60 s:
  /// far longer than a training step, short enough that a crash does not stall training long.
  std::chrono::milliseconds worker_timeout{60000};
  /// Largest message accepted (see message.h's Limits).
  int64_t max_message_bytes = int64_t{1} << 30;
  /// Log rejected messages and dead workers to stderr.
  bool verbose = true;
  /// When set, the shard (values and optimizer state, see shard_state()) is saved here in
  /// PyTorch's format (torch.load reads it as a dict of tensors; written atomically) when run()
  /// ends, every `checkpoint_every` updates (0: only at the end), and at each checkpoint barrier
  /// unless step_checkpoint_prefix is set.
  std::string checkpoint_path;
  int64_t checkpoint_every = 0;
  /// When set, each checkpoint barrier (Worker::checkpoint_barrier(step)) saves the shard as
  /// step_checkpoint_path(prefix, step), holding the step too (kStepKey), and nothing else is
  /// saved: the workers save their checkpoint of that step next, and a resume restores the
  /// server file of the workers' step, so that a kill between the two saves never pairs the
  /// workers' state of one step with the server's of another. Saving step s deletes the files of
  /// later steps (a run cut off there and resumed earlier) and keeps `step_checkpoint_keep`
  /// files in all, the newest (0: all).
  std::string step_checkpoint_prefix;
  int step_checkpoint_keep = 0;
  /// When set, the shard is restored from this file at construction; the workers' init() then
  /// keeps the restored values (a resumed job continues where it was saved).
  std::string restore_path;
  /// When >= 0, the restored file must hold this step (kStepKey): else CheckpointError.
  int64_t restore_step = -1;
};

/// The entry of a shard file that holds the workers' step it was saved at (a 0-dim int64).
inline const char* const kStepKey = "__step__";

/// "<prefix>.step<step>.pt": the shard file a checkpoint barrier of `step` writes.
std::string step_checkpoint_path(const std::string& prefix, int64_t step);

/// What a server observed.
struct ServerStats {
  int64_t pushes = 0;            ///< gradients received
  int64_t updates = 0;           ///< optimizer steps applied (bsp: one per step)
  int64_t rejected = 0;          ///< malformed, oversized or unauthenticated messages
  int64_t auth_failures = 0;     ///< wrong answers to the challenge
  /// Connections the gate refused in ZeroMQ's handshake (a wrong gate password): they never
  /// reach the challenge, so auth_failures does not count them.
  int64_t gate_refusals = 0;
  int64_t deferred_pulls = 0;    ///< pulls that had to wait (bsp/ssp)
  /// Staleness of each push: the pusher's clock minus the slowest live worker's finished clocks.
  int64_t max_staleness = 0;
  std::map<int64_t, int64_t> staleness_counts;  ///< staleness -> number of pushes
  std::vector<int> dead_workers;                ///< presumed dead, in order
  std::vector<int> finished_workers;            ///< said goodbye
};

class Server {
 public:
  /// Binds now, so endpoint() is known before run().
  explicit Server(ServerOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  /// The bound endpoint, e.g. "tcp://127.0.0.1:40123".
  std::string endpoint() const;

  /// Serves until every worker finished or is presumed dead, or stop().
  void run();
  /// run() on a thread of its own; join() waits for it.
  void start();
  void join();
  /// Makes run() return within about 50 ms.
  void stop();

  ServerStats stats() const;

  /// The shard's parameters and optimizer state as one state dict:
  /// "<key>" -> values, "<key>.<state name>" -> optimizer state, plus "__meta__.<key>" ->
  /// [offset, numel] (int64). Call while run() is not running.
  std::map<std::string, at::Tensor> shard_state() const;
  /// Restores what shard_state() returned (the shard counts as initialized). Before run().
  void load_shard_state(const std::map<std::string, at::Tensor>& state);

 private:
  void check_restored_step(const std::map<std::string, at::Tensor>& state) const;

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shoal::ps
