// OpQueue: one thread that runs a process group's queued operations in order, and ShmWork, the
// Work handle it completes.
//
// The shm backend's operations take microseconds, so the hand-offs between the issuing thread and
// the worker must not cost more than the operation: the worker polls for new operations for a
// short while before it sleeps, and ShmWork::wait() polls for completion before it blocks.
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
class ShmWork : public Work {
 public:
  ShmWork(OpLabel label, Milliseconds timeout);

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
};

class OpQueue {
 public:
  /// `name` names the thread in error messages.
  explicit OpQueue(std::string name);
  /// Runs what is queued, then joins the thread.
  ~OpQueue();

  void enqueue(std::function<void()> task);
  /// True when nothing is queued or running: a task may then run on the caller's thread instead
  /// without reordering (the caller is the only thread that enqueues).
  bool idle() const { return pending_.load(std::memory_order_acquire) == 0; }

 private:
  void loop();

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  std::atomic<int> pending_{0};  // queued + running
  bool stopping_ = false;
  bool sleeping_ = false;
  std::string name_;
  std::thread thread_;
};

}  // namespace shoal::comm::shm
