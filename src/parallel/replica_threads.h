// ReplicaThreads: the persistent worker threads of DataParallel, one per replica slot.
//
// Each slot owns one thread, started once and kept for the wrapper's lifetime, so a step costs two
// condition-variable hand-offs per replica instead of a thread start. A CPU slot sets its own
// intra-op thread count (at::set_num_threads on its thread) when it starts; the caller's
// thread-local state (grad mode, inference mode, ...) is carried into each job.
//
// run() hands one job to each of the first n slots, waits for all of them (up to a deadline) and
// reports every failure with its slot. A slot that overran the deadline may still be running its
// job (it cannot be cancelled): run() throws at the deadline, the slot keeps its own reference to
// the job (so what the job captured by shared_ptr stays alive), and the pool refuses further work.
// The destructor joins the threads, so it waits for such a job to end.
//
// Thread safety: run() is called from one thread at a time (the wrapper's caller).
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace shoal::parallel {

class ReplicaThreads {
 public:
  /// `slots` threads; each calls at::set_num_threads(intra_op_threads) first when that is > 0.
  ReplicaThreads(int slots, int intra_op_threads);
  ~ReplicaThreads();
  ReplicaThreads(const ReplicaThreads&) = delete;
  ReplicaThreads& operator=(const ReplicaThreads&) = delete;

  int size() const { return static_cast<int>(slots_.size()); }

  /// The message of a failure a job threw (c10::Error without its C++ backtrace).
  static std::string message_of(const std::exception_ptr& error);

  /// What became of one slot's job.
  struct Outcome {
    std::exception_ptr error;  ///< what the job threw, or null
    double seconds = 0;        ///< how long the job ran
  };

  /// Runs job(slot) on slots 0..n-1 in parallel and waits for all of them. Throws TimeoutError
  /// naming the slots still running when `timeout` passes; otherwise returns each slot's outcome
  /// (failures are the caller's to report).
  std::vector<Outcome> run(int n, std::shared_ptr<const std::function<void(int slot)>> job,
                           std::chrono::milliseconds timeout);

 private:
  struct Slot;
  void loop(Slot& slot);

  std::vector<std::unique_ptr<Slot>> slots_;
  std::mutex mutex_;
  std::condition_variable done_;
  int pending_ = 0;
  bool broken_ = false;
};

}  // namespace shoal::parallel
