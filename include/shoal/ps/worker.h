// A parameter-server worker: pushes its parameters' gradients to the servers that own them and
// pulls the parameters back, for users' own training loops:
//
//   shoal::ps::Worker ps(options, model->named_parameters());   // connects, authenticates
//   ps.init();                         // rank 0's weights go to the servers; everyone pulls them
//   for (...) { model->zero_grad(); loss(model(x), y).backward(); ps.step(); }   // push + pull
//   ps.close();                        // goodbye: the servers stop waiting for this worker
//
// Parameters are split over the servers by partition_parameters(); a pull copies into the
// parameters only the ranges that changed since the last pull. Whether a pull waits (bsp, ssp)
// is the servers' decision. Every exchange has a deadline (timeout): a dead server makes step()
// throw PeerError naming the server and its endpoint; an error answer is thrown likewise.
//
// Thread safety: one thread at a time.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace shoal::ps {

struct WorkerOptions {
  /// The servers' endpoints, by server rank.
  std::vector<std::string> servers;
  int rank = 0;
  int num_workers = 1;
  /// The shared token (see ServerOptions); defaults to $SHOAL_AUTH_TOKEN.
  std::string auth_token;
  bool auth_token_from_env = true;
  /// Longest wait for any answer. Why 120 s: longer than a server's worker_timeout, so that a
  /// worker waiting on a dead peer hears the server's verdict rather than timing out first.
  std::chrono::milliseconds timeout{120000};
  /// Ranges of parameters larger than this many elements are split over the servers.
  int64_t split_threshold = 65536;
  int64_t max_message_bytes = int64_t{1} << 30;
};

class Worker {
 public:
  /// Connects to every server and authenticates. `parameters` are the tensors trained (float32,
  /// contiguous, CPU); their .grad() is what push() sends.
  Worker(WorkerOptions options, std::vector<std::pair<std::string, at::Tensor>> parameters);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  /// Rank 0 sends its parameter values to the servers; then every worker pulls them.
  void init();
  /// Sends the gradients (parameters without one are skipped) tagged with clock(), then advances
  /// the clock.
  void push();
  /// Waits as the consistency model says, then copies the changed ranges into the parameters.
  void pull();
  /// push() then pull().
  void step();
  /// The factor on the servers' learning rate that the following pushes carry (a schedule's
  /// value for the coming clocks, as PyTorch's LambdaLR: lr = base lr x factor); 1 by default.
  /// Under bsp a step uses the mean of its pushes' factors. The trainer sets it from
  /// TrainOptions::lr_schedule.
  void set_lr_factor(double factor);
  /// Sums `values` over the live workers (through server 0).
  std::vector<double> all_reduce_sum(const std::vector<double>& values);
  /// Returns once every live worker has called it (on every server): all their pushes are
  /// applied.
  void barrier();
  /// barrier(), and each server that saves checkpoints saves its shard first, as the shard of
  /// `step` (the step of the workers' checkpoint that follows; every worker passes the same), so
  /// the files hold exactly the state every worker pulls next (see ServerOptions).
  void checkpoint_barrier(int64_t step);
  /// Tells every server this worker is done (idempotent; the destructor calls it, ignoring errors).
  void close();

  int rank() const;
  int num_workers() const;
  /// Pushes done.
  int64_t clock() const;
  /// Seconds spent waiting in pull() (bsp/ssp hold-ups and transfer).
  double pull_seconds() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shoal::ps
