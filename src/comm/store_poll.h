// Waiting for keys by polling check(), for the stores whose wire has no wait of its own that a
// deadline can cut short (c10d's, private to the library); and the time-out every store wait throws.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "comm/timeouts.h"
#include "shoal/error.h"

namespace shoal::comm {

/// Throws the TimeoutError of a wait for `keys` at `where` that lasted `timeout`.
[[noreturn]] inline void throw_wait_timeout(const std::vector<std::string>& keys, Milliseconds timeout,
                                            const std::string& where, const std::string& who = "") {
  std::string names;
  for (const auto& k : keys) names += (names.empty() ? "'" : ", '") + k + "'";
  SHOAL_THROW(TimeoutError, who, "store wait for ", names, " at ", where, " timed out after ",
              timeout.count(), " ms", kTimeoutHint);
}

/// Calls `check` until it returns true, from 1 ms up to 20 ms apart (fast while ranks arrive
/// together, cheap while one is late); throws TimeoutError naming `keys` and `where` once `timeout`
/// has passed (`who`, e.g. "[rank 1] ", leads the message).
inline void wait_by_polling(const std::function<bool()>& check,
                            const std::vector<std::string>& keys, Milliseconds timeout,
                            const std::string& where, const std::string& who = "") {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::milliseconds(1);
  while (!check()) {
    if (std::chrono::steady_clock::now() >= deadline) throw_wait_timeout(keys, timeout, where, who);
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(20));
  }
}

}  // namespace shoal::comm
