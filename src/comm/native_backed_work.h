// NativeBackedWork: a Shoal Work over a pending c10d operation (compat::NativeWork), shared by the
// backends built on c10d (Gloo, NCCL).
//
// Waits with a deadline, runs the finishing step (copy-back, division) once, and turns c10d's
// errors into Shoal's (TimeoutError, PeerError) naming the rank, the operation with its sequence
// number, and, through the PeerDirectory, the peer at fault.
//
// Thread safety: as Work (any thread may wait; the first waiter finishes the operation).
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <mutex>

#include "compat/c10d_group.h"
#include "shoal/comm/process_group.h"
#include "shoal/comm/work.h"

namespace shoal::comm {

class PeerDirectory;

class NativeBackedWork : public Work {
 public:
  /// `on_success` runs once, on the waiting thread, when the operation has succeeded.
  NativeBackedWork(const OpContext& ctx, std::unique_ptr<compat::NativeWork> native,
                   std::shared_ptr<PeerDirectory> peers, std::function<void()> on_success)
      : Work(ctx.label),
        timeout_(ctx.timeout),
        native_(std::move(native)),
        peers_(std::move(peers)),
        on_success_(std::move(on_success)) {}

  bool is_completed() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return finished_ || native_->is_completed();
  }

  void wait(Milliseconds timeout) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!finished_) finish(timeout == kGroupTimeout ? timeout_ : timeout);
    if (error_) std::rethrow_exception(error_);
  }

  std::exception_ptr exception() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }

 private:
  void finish(Milliseconds timeout);

  std::mutex mutex_;
  Milliseconds timeout_;
  std::unique_ptr<compat::NativeWork> native_;
  std::shared_ptr<PeerDirectory> peers_;
  std::function<void()> on_success_;
  bool finished_ = false;
  std::exception_ptr error_;
};

}  // namespace shoal::comm
