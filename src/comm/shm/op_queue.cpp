#include "comm/shm/op_queue.h"

#include <chrono>

#include "comm/timeouts.h"
#include "shoal/error.h"

namespace shoal::comm::shm {
namespace {

using Clock = std::chrono::steady_clock;

// How long a waiter polls before it blocks on a condition variable. A futex wake-up costs
// 5-50 us on a loaded machine, more than a small shm operation; 50 us of polling covers those
// operations (and DDP's back-to-back buckets) while costing little when the wait is long.
constexpr auto kPollTime = std::chrono::microseconds(50);

}  // namespace

ShmWork::ShmWork(OpLabel label, Milliseconds timeout, std::weak_ptr<OpQueue> queue)
    : Work(std::move(label)), timeout_(timeout), queue_(std::move(queue)) {}

void ShmWork::wait(Milliseconds timeout) {
  if (timeout == kGroupTimeout) timeout = timeout_;
  // Running the operation here may take as long as the operation's own deadline allows: only a
  // wait prepared to wait that long may do it.
  if (timeout >= timeout_ && !done_.load(std::memory_order_acquire)) {
    if (auto queue = queue_.lock()) queue->help(this);
  }
  if (!done_.load(std::memory_order_acquire)) {
    const auto poll_end = Clock::now() + kPollTime;
    while (!done_.load(std::memory_order_acquire) && Clock::now() < poll_end) {
      std::this_thread::yield();
    }
  }
  if (!done_.load(std::memory_order_acquire)) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!done_cv_.wait_for(lock, timeout, [&] { return done_.load(); })) {
      SHOAL_THROW(TimeoutError, label().prefix(), " timed out after ", timeout.count(),
                  " ms waiting for it to complete", kTimeoutHint);
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (error_) std::rethrow_exception(error_);
}

std::exception_ptr ShmWork::exception() {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

void ShmWork::finish(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = std::move(error);
    done_.store(true, std::memory_order_release);
  }
  done_cv_.notify_all();
}

OpQueue::OpQueue(std::string name) : name_(std::move(name)), thread_([this] { loop(); }) {}

OpQueue::~OpQueue() { stop(); }

void OpQueue::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void OpQueue::enqueue(std::function<void()> task, const Work* owner) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.push_back({std::move(task), owner});
    pending_.fetch_add(1, std::memory_order_acq_rel);
    wake = sleeping_;
  }
  if (wake) cv_.notify_one();
}

const Work* OpQueue::run_front(std::unique_lock<std::mutex>& lock) {
  Task task = std::move(tasks_.front());
  tasks_.pop_front();
  running_ = true;
  lock.unlock();
  task.run();  // tasks catch their own errors and complete their Work
  pending_.fetch_sub(1, std::memory_order_acq_rel);
  lock.lock();
  running_ = false;
  return task.owner;
}

bool OpQueue::help(const Work* owner) {
  std::unique_lock<std::mutex> lock(mutex_);
  const auto queued = [&] {
    for (const Task& task : tasks_) {
      if (task.owner == owner) return true;
    }
    return false;
  };
  if (running_ || !queued()) return false;
  // From here only this thread runs tasks (running_ holds the worker off), in queue order.
  while (run_front(lock) != owner) {
  }
  // The worker sleeps while a task runs here; what is left (or its exit) is its again.
  if (sleeping_ && (!tasks_.empty() || stopping_)) cv_.notify_one();
  return true;
}

void OpQueue::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  bool ran = false;  // whether this thread just ran a task (then it polls before sleeping)
  for (;;) {
    if (!tasks_.empty() && !running_) {
      run_front(lock);
      ran = true;
      continue;
    }
    if (stopping_ && tasks_.empty() && !running_) return;  // everything queued has run
    if (ran && !stopping_) {
      // Poll briefly (see kPollTime) before sleeping: operations often come back to back.
      ran = false;
      lock.unlock();
      const auto poll_end = Clock::now() + kPollTime;
      while (pending_.load(std::memory_order_acquire) == 0 && Clock::now() < poll_end) {
        std::this_thread::yield();
      }
      lock.lock();
      continue;
    }
    sleeping_ = true;
    cv_.wait(lock, [&] { return !running_ && (!tasks_.empty() || stopping_); });
    sleeping_ = false;
  }
}

}  // namespace shoal::comm::shm
