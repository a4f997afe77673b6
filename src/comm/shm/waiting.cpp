// ProcessGroupShm: failure (abort, a wait that fails) and the rounds of a collective.
#include "comm/shm/process_group_shm.h"

#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <new>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "comm/peer_directory.h"
#include "comm/shm/op_queue.h"
#include "comm/shm/reduce_kernels.h"
#include "comm/shm/segment_layout.h"
#include "comm/shm/waiting.h"
#include "comm/timeouts.h"
#include "shoal/error.h"
#include "shoal/log.h"

namespace shoal::comm::shm {

void ProcessGroupShm::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    if (aborted_.load()) return;
    abort_reason_ = reason;
    aborted_.store(true);
  }
  if (header_ == nullptr) return;
  auto& mine = controls_[rank()];
  std::strncpy(mine.abort_reason, reason.c_str(), kReasonBytes - 1);
  mine.abort_reason[kReasonBytes - 1] = '\0';
  int32_t none = 0;
  header_->abort_rank.compare_exchange_strong(none, rank() + 1, std::memory_order_acq_rel);
}

void ProcessGroupShm::check_not_aborted(const OpContext& ctx) {
  if (aborted_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    SHOAL_THROW(PeerError, ctx.prefix(), " cannot run: the group was aborted after an earlier "
                "failure: ", abort_reason_);
  }
  const int32_t culprit = header_->abort_rank.load(std::memory_order_acquire);
  if (culprit != 0) {
    const std::string reason = controls_[culprit - 1].abort_reason;
    abort(reason);
    SHOAL_THROW(PeerError, ctx.prefix(), " cannot run: rank ", culprit - 1,
                " aborted the group: ", reason);
  }
}

void ProcessGroupShm::fail_waiting(int peer, const Running& op, const char* why) {
  const auto waited =
      std::chrono::duration_cast<Milliseconds>(Clock::now() - op.start).count();
  const int pid = controls_[peer].pid.load(std::memory_order_relaxed);
  const std::string who = detail::str_cat("rank ", peer, " (pid ", pid, ")");
  std::string message;
  bool timeout = false;
  if (std::strcmp(why, "exited") == 0) {
    message = detail::str_cat(op.ctx->prefix(), " failed after ", waited, " ms waiting for ", who,
                              ": the process has exited");
  } else if (std::strcmp(why, "stopped") == 0) {
    message = detail::str_cat(op.ctx->prefix(), " failed after ", waited, " ms waiting for ", who,
                              ": the process has been stopped (SIGSTOP, Ctrl-Z or a debugger) for ",
                              stopped_peer_timeout().count(), " ms");
  } else if (std::strcmp(why, "aborted") == 0) {
    const int32_t culprit = header_->abort_rank.load(std::memory_order_acquire);
    std::string reason;
    if (culprit > 0) {
      reason = controls_[culprit - 1].abort_reason;
    } else {
      std::lock_guard<std::mutex> lock(abort_mutex_);
      reason = abort_reason_;
    }
    message = detail::str_cat(op.ctx->prefix(), " failed after ", waited, " ms waiting for ", who,
                              ": ", culprit > 0 ? detail::str_cat("rank ", culprit - 1,
                                                                  " aborted the group: ")
                                                : "the group was aborted: ",
                              reason);
  } else {
    timeout = true;
    const uint64_t their_seq = controls_[peer].op_sequence.load(std::memory_order_relaxed);
    const int their_op = controls_[peer].op_code.load(std::memory_order_relaxed);
    const std::string where =
        their_seq == 0 ? std::string("has not started any collective")
                       : detail::str_cat("was last seen in ", kOpNames[their_op], " #", their_seq);
    message = detail::str_cat(op.ctx->prefix(), " timed out after ", waited, " ms waiting for ",
                              who, ", which ", where, kTimeoutHint);
  }
  abort(message);  // first: the other ranks fail at once, and gather their reports meanwhile
  // Who is behind and where: every rank's last operations (not needed when the peer is dead).
  if (std::strcmp(why, "exited") != 0) message += hang_report();
  if (timeout) SHOAL_THROW(TimeoutError, message);
  SHOAL_THROW(PeerError, message);
}

uint8_t* ProcessGroupShm::my_buffer(uint64_t round) const {
  return slots_ + (static_cast<size_t>(rank()) * 2 + round % 2) * options_.chunk_bytes;
}

const uint8_t* ProcessGroupShm::peer_buffer(int peer, uint64_t round) const {
  return slots_ + (static_cast<size_t>(peer) * 2 + round % 2) * options_.chunk_bytes;
}

uint8_t* ProcessGroupShm::begin_write(const Running& op) {
  // Buffer round_ % 2 last held round round_ - 2, which every peer has finished reading once it
  // has posted round round_ - 1.
  if (peers_posted_min_ < round_) wait_all_posted(round_, op);
  return my_buffer(round_);
}

void ProcessGroupShm::post() {
  ++round_;
  controls_[rank()].posted.store(round_, std::memory_order_release);
}

void ProcessGroupShm::wait_posted(int peer, uint64_t value, const Running& op) {
  const auto& posted = controls_[peer].posted;
  wait_until(peer, op, [&] { return posted.load(std::memory_order_acquire) >= value; });
}

void ProcessGroupShm::wait_all_posted(uint64_t value, const Running& op) {
  if (peers_posted_min_ >= value) return;
  for (int peer = 0; peer < size(); ++peer) {
    if (peer != rank()) wait_posted(peer, value, op);
  }
  peers_posted_min_ = value;
}

}  // namespace shoal::comm::shm
