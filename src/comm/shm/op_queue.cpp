#include "comm/shm/op_queue.h"

#include <chrono>

#include "shoal/error.h"

namespace shoal::comm::shm {
namespace {

using Clock = std::chrono::steady_clock;

// How long a waiter polls before it blocks on a condition variable. A futex wake-up costs
// 5-50 us on a loaded machine, more than a small shm operation; 50 us of polling covers those
// operations (and DDP's back-to-back buckets) while costing little when the wait is long.
constexpr auto kPollTime = std::chrono::microseconds(50);

}  // namespace

ShmWork::ShmWork(OpLabel label, Milliseconds timeout) : Work(std::move(label)), timeout_(timeout) {}

void ShmWork::wait(Milliseconds timeout) {
  if (timeout == kGroupTimeout) timeout = timeout_;
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
                  " ms waiting for it to complete");
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

OpQueue::~OpQueue() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void OpQueue::enqueue(std::function<void()> task) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.push_back(std::move(task));
    pending_.fetch_add(1, std::memory_order_acq_rel);
    wake = sleeping_;
  }
  if (wake) cv_.notify_one();
}

void OpQueue::loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (tasks_.empty() && !stopping_) {
        // Poll briefly (see kPollTime) before sleeping.
        lock.unlock();
        const auto poll_end = Clock::now() + kPollTime;
        while (pending_.load(std::memory_order_acquire) == 0 && Clock::now() < poll_end) {
          std::this_thread::yield();
        }
        lock.lock();
        sleeping_ = true;
        cv_.wait(lock, [&] { return !tasks_.empty() || stopping_; });
        sleeping_ = false;
      }
      if (tasks_.empty()) return;  // stopping, and everything queued has run
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();  // tasks catch their own errors and complete their Work
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace shoal::comm::shm
