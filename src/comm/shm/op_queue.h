// OpQueue: one thread that runs a process group's queued operations in order, and ShmWork, the
// Work handle it completes.
//
// The shm backend's operations take microseconds, so the hand-offs between the issuing thread and
// the worker must not cost more than the operation: the worker polls for new operations for a
// short while before it sleeps, and ShmWork::wait() polls for completion before it blocks.
// A thread that waits for an operation the worker has not started yet runs it (and any queued
// before it) itself, in order: a blocking call (allreduce(t)->wait()) then costs no hand-off, and
// the worker does not compete with its own caller for a CPU (a machine with no spare CPU per rank
// is the common case for CPU training). Operations started and not waited for (DDP's buckets
// during backward) still run on the worker, overlapped with the caller.
//
// Thread safety: enqueue() from one thread at a time (the group's issuing thread); ShmWork from
// any thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "shoal/comm/work.h"

namespace shoal::comm::shm {

/// A Work completed by an OpQueue task (or inline), cheap to wait on when it completes soon.
class OpQueue;

class ShmWork : public Work {
 public:
  /// `queue`: where the operation waits to run, if anywhere (wait() may then run it itself).
  ShmWork(OpLabel label, Milliseconds timeout, std::weak_ptr<OpQueue> queue = {});

  bool is_completed() override { return done_.load(std::memory_order_acquire); }
  void wait(Milliseconds timeout = kGroupTimeout) override;
  std::exception_ptr exception() override;

  void finish(std::exception_ptr error = nullptr);

 private:
  std::atomic<bool> done_{false};
  std::mutex mutex_;
  std::condition_variable done_cv_;
  std::exception_ptr error_;
  Milliseconds timeout_;
  std::weak_ptr<OpQueue> queue_;
};

class OpQueue {
 public:
  /// `name` names the thread in error messages.
  explicit OpQueue(std::string name);
  /// Runs what is queued, then joins the thread (stop()).
  ~OpQueue();
  /// Runs what is queued (a helping thread may run some), then joins the thread; returns once no
  /// task runs any more. Idempotent. Call from the thread that enqueues, never from a task.
  void stop();

  /// `owner`: the Work the task completes (for help()), or null.
  void enqueue(std::function<void()> task, const Work* owner = nullptr);
  /// Runs, on the calling thread, the queued tasks up to and including `owner`'s, unless a task
  /// is running (the worker's order must hold) or `owner`'s is not queued. True if it ran it.
  bool help(const Work* owner);
  /// True when nothing is queued or running: a task may then run on the caller's thread instead
  /// without reordering (the caller is the only thread that enqueues).
  bool idle() const { return pending_.load(std::memory_order_acquire) == 0; }

 private:
  void loop();

  std::mutex mutex_;
  std::condition_variable cv_;
  struct Task {
    std::function<void()> run;
    const Work* owner;
  };
  // Pops and runs the front task with `lock` held on entry and on return (released while it runs).
  const Work* run_front(std::unique_lock<std::mutex>& lock);

  std::deque<Task> tasks_;
  std::atomic<int> pending_{0};  // queued + running
  bool running_ = false;          // a task runs, on the worker or a helping thread
  bool stopping_ = false;
  bool sleeping_ = false;
  std::string name_;
  std::thread thread_;
};

}  // namespace shoal::comm::shm
