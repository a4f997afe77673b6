// The error file of a failing process, for its launcher: torchelastic's JSON at
// $TORCHELASTIC_ERROR_FILE (torchrun, and shoal's launcher, set one for each worker), stamped with
// the time the process noted its failure. The first worker to exit is often not the first that
// failed: rank 0's failure stops the others (its store closes, a broadcast says it failed), and
// they may be done exiting before it is. A launcher names the worker of the earliest stamp.
//
// Thread safety: note_failure() may be called from any thread; write_error_file() from one.
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <string>

namespace shoal::log {

/// The variable naming the file (torchelastic's name, so that torchrun reads Shoal's files too).
inline constexpr const char* kErrorFileEnv = "TORCHELASTIC_ERROR_FILE";

/// Notes that this process is failing, now; the first call's time is the failure's. Call it where
/// an error is caught before the process lets its peers know (they fail after it).
void note_failure();

/// Notes the failure of an exception that leaves its scope, when it goes. Declare it after what
/// tells the peers (a store a process hosts, a process group), so that it notes before they go.
class FailureNote {
 public:
  ~FailureNote() {
    if (std::uncaught_exceptions() > exceptions_) note_failure();
  }

 private:
  int exceptions_ = std::uncaught_exceptions();
};

/// Writes `message` to $TORCHELASTIC_ERROR_FILE when it is set (nothing when it is not, or cannot
/// be written), stamped with the first note_failure()'s time, or now.
void write_error_file(const std::string& message);

/// What an error file says.
struct ErrorFile {
  std::string message;
  int64_t time_us = 0;  ///< when the process failed, in microseconds since the epoch
};

/// The error file at `path`; nullopt when there is none, or it holds no stamp of Shoal's.
std::optional<ErrorFile> read_error_file(const std::string& path);

/// Microseconds since the epoch, now: the clock error files are stamped with.
int64_t epoch_us();

}  // namespace shoal::log
