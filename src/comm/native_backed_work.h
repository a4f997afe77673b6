// NativeBackedWork: a Shoal Work over a pending c10d operation (compat::NativeWork), shared by the
// backends built on c10d (Gloo, NCCL).
//
// Waits with a deadline, runs the finishing step (copy-back, division) once, and turns c10d's
// errors into Shoal's (TimeoutError, PeerError) naming the rank, the operation with its sequence
// number, and, through the PeerDirectory, the peer at fault.
//
// Thread safety: as Work (any thread may wait; the first waiter finishes the operation).
#pragma once

#include <atomic>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>

#include "compat/c10d_group.h"
#include "shoal/comm/process_group.h"
#include "shoal/comm/work.h"

namespace shoal::comm {

class HangReporter;
class PeerDirectory;

class NativeBackedWork : public Work {
 public:
  /// `on_success` runs once, on the waiting thread, when the operation has succeeded. `reports`
  /// (may be null) adds every rank's last operations to a time-out's message. With
  /// `watch_heartbeats` (and `reports`) a wait longer than a poll interval also watches the other
  /// ranks' heartbeats, and fails once one has stood still for silent_peer_timeout(): for
  /// operations whose native wait may be called again after returning false (Gloo's collectives;
  /// not its send/recv, which a timed-out wait completes with an error).
  NativeBackedWork(const OpContext& ctx, std::unique_ptr<compat::NativeWork> native,
                   std::shared_ptr<PeerDirectory> peers, std::shared_ptr<HangReporter> reports,
                   std::function<void()> on_success, bool watch_heartbeats = false)
      : Work(ctx.label),
        timeout_(ctx.timeout),
        native_(std::move(native)),
        peers_(std::move(peers)),
        reports_(std::move(reports)),
        on_success_(std::move(on_success)),
        watch_heartbeats_(watch_heartbeats && reports_ != nullptr) {}

  bool is_completed() override {
    if (finished_.load(std::memory_order_acquire)) return true;
    // A wait holds mutex_ for as long as it waits: is_completed never blocks on it (the flight
    // recorder and the hang report ask from other threads, and from the waiting thread itself).
    if (waiters_.load(std::memory_order_acquire) > 0) return false;
    std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
    if (!lock.owns_lock()) return false;
    return finished_ || native_->is_completed();
  }

  void wait(Milliseconds timeout) override {
    waiters_.fetch_add(1, std::memory_order_acq_rel);  // before the lock: see is_completed()
    struct Leave {
      std::atomic<int>& waiters;
      ~Leave() { waiters.fetch_sub(1, std::memory_order_acq_rel); }
    } leave{waiters_};
    std::lock_guard<std::mutex> lock(mutex_);
    if (!finished_) finish(timeout == kGroupTimeout ? timeout_ : timeout);
    if (error_) std::rethrow_exception(error_);
  }

  /// Runs once, on the waiting thread, when the operation fails (time-out, dead or silent peer):
  /// the backend marks its group as broken (see ProcessGroupGloo's destructor).
  void set_on_failure(std::function<void()> on_failure) { on_failure_ = std::move(on_failure); }

  std::exception_ptr exception() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }

 private:
  void finish(Milliseconds timeout);
  /// native_->wait(timeout), in slices that watch the heartbeats (see the constructor); throws
  /// PeerError naming a silent peer.
  bool wait_native(Milliseconds timeout);

  std::mutex mutex_;
  Milliseconds timeout_;
  std::unique_ptr<compat::NativeWork> native_;
  std::shared_ptr<PeerDirectory> peers_;
  std::shared_ptr<HangReporter> reports_;
  std::function<void()> on_success_;
  std::function<void()> on_failure_;
  bool watch_heartbeats_;
  std::atomic<bool> finished_{false};
  std::atomic<int> waiters_{0};
  std::exception_ptr error_;
};

}  // namespace shoal::comm
