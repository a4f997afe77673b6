// ScopedEnv: sets (or, given nullptr, unsets) one environment variable for a scope and restores
// its previous value at the end, so that a test case leaves the process as it found it.
//
// Thread safety: none; setenv is not safe while other threads read the environment, so use it
// before starting a test's threads.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

namespace shoal::testing {

class ScopedEnv {
 public:
  ScopedEnv(std::string name, const char* value) : name_(std::move(name)) {
    if (const char* old = std::getenv(name_.c_str())) previous_ = old;
    set(value);
  }
  ~ScopedEnv() { set(previous_ ? previous_->c_str() : nullptr); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  void set(const char* value) {
    if (value != nullptr) {
      ::setenv(name_.c_str(), value, 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }

  std::string name_;
  std::optional<std::string> previous_;
};

}  // namespace shoal::testing
