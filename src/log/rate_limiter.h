// RateLimiter: lets at most N log lines a second through and counts those it holds back, so that
// a peer sending a flood of bad input cannot flood the log (or slow the listener that writes it).
// The next line let through says how many were held back before it.
//
//   if (int64_t held = 0; limiter_.allow(&held)) log::warn(line, limiter_.held_note(held));
//
// Thread safety: allow() may be called from any thread (a mutex).
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace shoal::log {

class RateLimiter {
 public:
  /// Why 10 by default: enough to show what is going on, few enough to read.
  explicit RateLimiter(int lines_per_second = 10) : per_second_(lines_per_second) {}

  /// Whether a line may be written now; when it may, `*held` is how many were held back since
  /// the last one let through.
  bool allow(int64_t* held) {
    const auto now = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> lock(mutex_);
    if (now - window_start_ >= std::chrono::seconds(1)) {
      window_start_ = now;
      in_window_ = 0;
    }
    if (in_window_ >= per_second_) {
      ++held_;
      return false;
    }
    ++in_window_;
    *held = held_;
    held_ = 0;
    return true;
  }

  /// Lines held back so far and not yet reported.
  int64_t held() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return held_;
  }

  /// " (N more lines like this were held back ...)" after `held` were held back; "" for 0.
  std::string held_note(int64_t held) const {
    if (held == 0) return "";
    return " (" + std::to_string(held) + " more line" + (held == 1 ? "" : "s") +
           " like this held back before it: at most " + std::to_string(per_second_) +
           " a second are written)";
  }

 private:
  const int per_second_;
  mutable std::mutex mutex_;
  std::chrono::steady_clock::time_point window_start_{};
  int in_window_ = 0;
  int64_t held_ = 0;
};

}  // namespace shoal::log
