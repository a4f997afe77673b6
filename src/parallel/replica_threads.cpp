#include "parallel/replica_threads.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/util/Exception.h>

#include "shoal/error.h"

namespace shoal::parallel {

struct ReplicaThreads::Slot {
  int index = 0;
  int intra_op_threads = 0;
  std::condition_variable wake;
  std::shared_ptr<const std::function<void(int)>> job;  // set while a job is queued or running
  std::unique_ptr<at::ThreadLocalState> state;     // the caller's, captured at run()
  Outcome outcome;
  bool stop = false;
  std::thread thread;
};

std::string ReplicaThreads::message_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

ReplicaThreads::ReplicaThreads(int slots, int intra_op_threads) {
  SHOAL_CHECK_T(InvalidArgument, slots >= 1, "DataParallel: needs at least one replica slot, got ",
                slots);
  for (int i = 0; i < slots; ++i) {
    auto slot = std::make_unique<Slot>();
    slot->index = i;
    slot->intra_op_threads = intra_op_threads;
    slots_.push_back(std::move(slot));
  }
  for (auto& slot : slots_) {
    Slot* s = slot.get();
    s->thread = std::thread([this, s] { loop(*s); });
  }
}

ReplicaThreads::~ReplicaThreads() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& slot : slots_) {
      slot->stop = true;
      slot->wake.notify_one();
    }
  }
  for (auto& slot : slots_) {
    // A slot that overran its deadline may still be inside a job that uses the caller's objects;
    // joining is the only safe end (detaching would let it touch freed memory).
    if (slot->thread.joinable()) slot->thread.join();
  }
}

void ReplicaThreads::loop(Slot& slot) {
  if (slot.intra_op_threads > 0) at::set_num_threads(slot.intra_op_threads);
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    slot.wake.wait(lock, [&] { return slot.stop || slot.job != nullptr; });
    if (slot.job == nullptr) return;  // stop, nothing queued
    std::shared_ptr<const std::function<void(int)>> job = slot.job;
    std::unique_ptr<at::ThreadLocalState> state = std::move(slot.state);
    lock.unlock();
    Outcome outcome;
    const auto start = std::chrono::steady_clock::now();
    try {
      at::ThreadLocalStateGuard guard(*state);
      (*job)(slot.index);
    } catch (...) {
      outcome.error = std::current_exception();
    }
    outcome.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    lock.lock();
    slot.outcome = outcome;
    slot.job = nullptr;
    if (--pending_ == 0) done_.notify_all();
  }
}

std::vector<ReplicaThreads::Outcome> ReplicaThreads::run(
    int n, std::shared_ptr<const std::function<void(int)>> job, std::chrono::milliseconds timeout) {
  SHOAL_CHECK_T(InvalidArgument, n >= 1 && n <= size(), "DataParallel: ", n,
                " replicas requested but only ", size(), " slots exist");
  std::unique_lock<std::mutex> lock(mutex_);
  SHOAL_CHECK(!broken_,
              "DataParallel: a replica overran its deadline in an earlier step and may still be "
              "running; this wrapper cannot be used any more");
  pending_ = n;
  for (int i = 0; i < n; ++i) {
    Slot& slot = *slots_[i];
    slot.state = std::make_unique<at::ThreadLocalState>();
    slot.job = job;
    slot.wake.notify_one();
  }
  if (!done_.wait_for(lock, timeout, [&] { return pending_ == 0; })) {
    broken_ = true;
    std::string running;
    for (int i = 0; i < n; ++i) {
      if (slots_[i]->job != nullptr) running += (running.empty() ? "" : ", ") + std::to_string(i);
    }
    SHOAL_THROW(TimeoutError, "DataParallel: replica(s) ", running, " ran past the ",
                timeout.count(), " ms deadline (still running; this DataParallel is unusable)");
  }
  std::vector<Outcome> outcomes;
  for (int i = 0; i < n; ++i) outcomes.push_back(slots_[i]->outcome);
  return outcomes;
}

}  // namespace shoal::parallel
