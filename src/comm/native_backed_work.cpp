#include "comm/native_backed_work.h"

#include "comm/hang_reporter.h"
#include "comm/peer_directory.h"
#include "shoal/error.h"

namespace shoal::comm {
namespace {

// How long a failed operation waits for the other ranks to report the same failure, so that the
// silent one can be named. Short: the error must arrive within about the time-out.
constexpr Milliseconds kDiagnoseBudget{2000};

}  // namespace

void NativeBackedWork::finish(Milliseconds timeout) {
  const auto start = std::chrono::steady_clock::now();
  try {
    if (!native_->wait(timeout)) {
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
}

}  // namespace shoal::comm
