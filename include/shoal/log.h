// Shoal's own diagnostic messages (what it tells the user on stderr while it works: a checkpoint
// skipped, a fallback taken, an oversubscribed machine), with levels, written through spdlog.
//
// The level comes from the environment variable SHOAL_LOG_LEVEL (debug, info, warn, error or off;
// default info), read when the first message is written, or from set_level(). Messages are single
// lines written as given, without a time stamp or level tag: each call site starts its line with
// who speaks ("shoal: ", "[rank 1/4] ", "ps server 0: "), so that the default output reads as it
// always has. Results a program prints (the progress bar, "final test accuracy", `shoal bench`
// JSON) and the one-line error of a failing CLI command are not diagnostics and do not go here.
//
//   shoal::log::info("shoal: resuming from ", path);
//   if (shoal::log::enabled(shoal::log::Level::kDebug)) shoal::log::debug("...", expensive());
//
// Thread safety: every function may be called from any thread; lines from different threads are
// never interleaved (spdlog's locked stderr sink). set_level takes effect for later messages.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "shoal/error.h"

namespace shoal::log {

/// How much Shoal says; each level includes those after it.
enum class Level { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3, kOff = 4 };

/// "debug", "info", "warn" (or "warning"), "error", "off" (any case) as a Level; nothing otherwise.
std::optional<Level> parse_level(std::string_view name);

/// The level's name as parse_level reads it.
const char* level_name(Level level);

/// The current level: set_level's, else SHOAL_LOG_LEVEL's, else kInfo. An unknown SHOAL_LOG_LEVEL
/// is reported once (as a warning) and read as info.
Level level();

/// Overrides SHOAL_LOG_LEVEL for the rest of the process.
void set_level(Level level);

/// Forgets set_level and the level read before: the next message reads SHOAL_LOG_LEVEL again.
void reset_level();

/// Whether a message at `level` is written now.
bool enabled(Level level);

/// Writes `line` (one line, no newline) to stderr when `level` is enabled, and flushes it.
void write(Level level, std::string_view line);

/// The pieces concatenated as in SHOAL_CHECK (strings, numbers, anything with operator<<); they
/// are not formatted at all when the level is off.
template <typename... Args>
void debug(Args&&... pieces) {
  if (enabled(Level::kDebug)) write(Level::kDebug, detail::str_cat(std::forward<Args>(pieces)...));
}
template <typename... Args>
void info(Args&&... pieces) {
  if (enabled(Level::kInfo)) write(Level::kInfo, detail::str_cat(std::forward<Args>(pieces)...));
}
template <typename... Args>
void warn(Args&&... pieces) {
  if (enabled(Level::kWarn)) write(Level::kWarn, detail::str_cat(std::forward<Args>(pieces)...));
}
template <typename... Args>
void error(Args&&... pieces) {
  if (enabled(Level::kError)) write(Level::kError, detail::str_cat(std::forward<Args>(pieces)...));
}

}  // namespace shoal::log
