// A handle on an asynchronous collective or point-to-point operation.
//
// Every ProcessGroup call returns at once with a Work; wait() blocks until the operation finished,
// failed or ran past its time-out, and rethrows the operation's error (a shoal::Error naming the
// rank, the operation, its sequence number and the peer).
//
// Thread safety: all methods may be called from any thread; wait() may be called more than once.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "shoal/comm/op_label.h"
#include "shoal/comm/types.h"

namespace shoal::comm {

class Work {
 public:
  virtual ~Work() = default;

  /// True once the operation has finished, successfully or not. Never blocks.
  virtual bool is_completed() = 0;

  /// Blocks until the operation finished; rethrows its error. With kGroupTimeout, waits at most the
  /// operation's own time-out; throws TimeoutError naming the operation when the wait runs out.
  virtual void wait(Milliseconds timeout = kGroupTimeout) = 0;

  /// The stored error of a failed operation, or null.
  virtual std::exception_ptr exception() = 0;

  /// Per-group sequence number of the operation (1 for the first collective of a group).
  uint64_t sequence_number() const { return label_.sequence; }

  /// Human-readable description: "allreduce #12 (4.0 MB float32, sum)" (built on first use).
  const std::string& description() const;

  /// What the operation is, for messages.
  const OpLabel& label() const { return label_; }

 protected:
  /// A process group's operation: described from its label when first asked.
  explicit Work(OpLabel label) : label_(std::move(label)) {}
  /// A Work made elsewhere (a user's comm hook): described by the text given.
  Work(uint64_t sequence_number, std::string description)
      : described_already_(true), description_(std::move(description)) {
    label_.sequence = sequence_number;
  }

 private:
  OpLabel label_;
  const bool described_already_ = false;
  mutable std::once_flag described_;
  mutable std::string description_;
};

/// A Work completed by whoever runs the operation (a backend's worker thread): call finish() or
/// finish_with_error() exactly once. Backends without a native handle of their own use it.
class PromiseWork : public Work {
 public:
  /// `timeout`: how long wait() with kGroupTimeout waits.
  PromiseWork(OpLabel label, Milliseconds timeout);

  bool is_completed() override;
  void wait(Milliseconds timeout = kGroupTimeout) override;
  std::exception_ptr exception() override;

  void finish();
  void finish_with_error(std::exception_ptr error);

  /// Runs `callback` once the work completes (at once when it already has), on the completing thread.
  void then(std::function<void()> callback);

 private:
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::exception_ptr error_;
  Milliseconds timeout_;
  std::vector<std::function<void()>> callbacks_;
};

/// A Work that is already complete (world size 1, empty tensors).
std::shared_ptr<Work> make_completed_work(OpLabel label);

}  // namespace shoal::comm
