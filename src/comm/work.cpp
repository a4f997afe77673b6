#include "shoal/comm/work.h"

#include "comm/timeouts.h"
#include "shoal/error.h"

namespace shoal::comm {

const std::string& Work::description() const {
  if (!described_already_) {
    std::call_once(described_, [this] { description_ = label_.description(); });
  }
  return description_;
}

PromiseWork::PromiseWork(OpLabel label, Milliseconds timeout)
    : Work(std::move(label)), timeout_(timeout) {}

bool PromiseWork::is_completed() {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

void PromiseWork::wait(Milliseconds timeout) {
  if (timeout == kGroupTimeout) timeout = timeout_;
  std::unique_lock<std::mutex> lock(mutex_);
  if (!done_cv_.wait_for(lock, timeout, [&] { return done_; })) {
    SHOAL_THROW(TimeoutError, label().prefix(), " timed out after ", timeout.count(),
                " ms waiting for it to complete", kTimeoutHint);
  }
  if (error_) std::rethrow_exception(error_);
}

std::exception_ptr PromiseWork::exception() {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

void PromiseWork::finish() { finish_with_error(nullptr); }

void PromiseWork::finish_with_error(std::exception_ptr error) {
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) return;
    done_ = true;
    error_ = std::move(error);
    callbacks.swap(callbacks_);
  }
  done_cv_.notify_all();
  for (auto& callback : callbacks) callback();
}

void PromiseWork::then(std::function<void()> callback) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!done_) {
      callbacks_.push_back(std::move(callback));
      return;
    }
  }
  callback();
}

std::shared_ptr<Work> make_completed_work(OpLabel label) {
  auto work = std::make_shared<PromiseWork>(std::move(label), Milliseconds(0));
  work->finish();
  return work;
}

}  // namespace shoal::comm
