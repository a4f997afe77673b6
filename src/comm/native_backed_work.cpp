#include "comm/native_backed_work.h"

#include <algorithm>
#include <cstdio>

#include "comm/hang_reporter.h"
#include "comm/peer_directory.h"
#include "comm/timeouts.h"
#include "shoal/error.h"

namespace shoal::comm {
bool NativeBackedWork::wait_native(Milliseconds timeout) {
  if (!watch_heartbeats_ || timeout <= kHangPollInterval) return native_->wait(timeout);
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  const Milliseconds limit = silent_peer_timeout();
  // The first slice is the whole of a usual operation: no store traffic and no extra wake-ups
  // unless the wait is long.
  Milliseconds slice = kHangPollInterval;
  for (;;) {
    if (native_->wait(slice)) return true;
    const auto now = Clock::now();
    if (now >= deadline) return false;
    for (const Silence& s : reports_->silent_ranks(limit, sequence_number())) {
      const auto waited = std::chrono::duration_cast<Milliseconds>(now - start).count();
      const double silent = std::chrono::duration<double>(s.silent_for).count();
      char seconds[32];
      std::snprintf(seconds, sizeof seconds, "%.1f s", silent);
      if (s.rank < 0) {
        SHOAL_THROW(PeerError, label().prefix(), " failed after ", waited,
                    " ms: the store has not answered this rank's heartbeat watch for ", seconds,
                    " (is the store's host stopped or cut off?)",
                    reports_->gather());
      }
      const std::string where = peers_ ? peers_->describe(s.rank) : "?";
      SHOAL_THROW(PeerError, label().prefix(), " failed after ", waited, " ms waiting for ",
                  "rank ", s.rank, where == "?" ? "" : " (" + where + ")",
                  ": its heartbeat has stood still for ", seconds,
                  " (the process is stopped: SIGSTOP, Ctrl-Z or a debugger; or its host is cut "
                  "off). A rank that is only slow keeps beating and is waited for; "
                  "SHOAL_HEARTBEAT_TIMEOUT sets the limit (now ", limit.count(), " ms)",
                  reports_->gather());
    }
    slice = std::min(kHangPollInterval, std::chrono::duration_cast<Milliseconds>(deadline - now));
    if (slice <= Milliseconds(0)) slice = Milliseconds(1);
  }
}

void NativeBackedWork::finish(Milliseconds timeout) {
  const auto start = std::chrono::steady_clock::now();
  try {
    if (!wait_native(timeout)) {
      const std::string blamed = peers_ ? peers_->diagnose(sequence_number(), kDiagnoseBudget) : "";
      SHOAL_THROW(TimeoutError, label().prefix(), " timed out after ", timeout.count(), " ms",
                  blamed.empty() ? "" : " waiting for ", blamed,
                  reports_ ? reports_->gather() : std::string());
    }
    if (on_success_) on_success_();
    finished_ = true;
  } catch (const shoal::TimeoutError&) {
    error_ = std::current_exception();
    finished_ = true;
  } catch (const shoal::PeerError&) {  // a silent peer, named by wait_native()
    error_ = std::current_exception();
    finished_ = true;
  } catch (const std::exception& e) {
    const auto elapsed = std::chrono::duration_cast<Milliseconds>(
        std::chrono::steady_clock::now() - start);
    std::string cause = e.what();
    cause = cause.substr(0, cause.find('\n'));
    const bool timed_out = cause.find("imed out") != std::string::npos ||
                           cause.find("imeout") != std::string::npos;
    const std::string blamed = peers_ ? peers_->diagnose(sequence_number(), kDiagnoseBudget) : "";
    const std::string message = detail::str_cat(
        label().prefix(), timed_out ? " timed out" : " failed", " after ", elapsed.count(), " ms",
        blamed.empty() ? "" : " waiting for ", blamed, ": ", cause);
    try {
      if (timed_out) {
        SHOAL_THROW(TimeoutError, message, reports_ ? reports_->gather() : std::string());
      }
      SHOAL_THROW(PeerError, message);
    } catch (...) {
      error_ = std::current_exception();
    }
    finished_ = true;
  }
  if (error_ && on_failure_) on_failure_();
}

}  // namespace shoal::comm
