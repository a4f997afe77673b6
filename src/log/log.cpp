#include "shoal/log.h"

#include <spdlog/logger.h>
#include <spdlog/sinks/stdout_sinks.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <memory>

namespace shoal::log {
namespace {

constexpr int kUnread = -1;  // SHOAL_LOG_LEVEL not read yet
std::atomic<int> current_level{kUnread};

/// The one logger of Shoal's diagnostics. Not in spdlog's registry: a program's own spdlog
/// loggers (and spdlog::set_level) neither see nor change it.
spdlog::logger& logger() {
  static const std::shared_ptr<spdlog::logger> instance = [] {
    auto made = std::make_shared<spdlog::logger>("shoal", std::make_shared<spdlog::sinks::stderr_sink_mt>());
    made->set_pattern("%v");  // the call sites say who speaks; see log.h
    made->set_level(spdlog::level::trace);  // filtered by level() before formatting
    made->flush_on(spdlog::level::trace);   // a line is on the terminal before the next step
    return made;
  }();
  return *instance;
}

spdlog::level::level_enum to_spdlog(Level level) {
  switch (level) {
    case Level::kDebug: return spdlog::level::debug;
    case Level::kInfo: return spdlog::level::info;
    case Level::kWarn: return spdlog::level::warn;
    case Level::kError: return spdlog::level::err;
    case Level::kOff: break;
  }
  return spdlog::level::off;
}

Level read_environment() {
  const char* text = std::getenv("SHOAL_LOG_LEVEL");
  if (text == nullptr || *text == '\0') return Level::kInfo;
  if (const auto parsed = parse_level(text)) return *parsed;
  logger().log(spdlog::level::warn,
               "shoal: warning: SHOAL_LOG_LEVEL={} is not one of debug, info, warn, error, off; "
               "using info", text);
  return Level::kInfo;
}

}  // namespace

std::optional<Level> parse_level(std::string_view name) {
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == "debug") return Level::kDebug;
  if (lower == "info") return Level::kInfo;
  if (lower == "warn" || lower == "warning") return Level::kWarn;
  if (lower == "error") return Level::kError;
  if (lower == "off") return Level::kOff;
  return std::nullopt;
}

const char* level_name(Level level) {
  switch (level) {
    case Level::kDebug: return "debug";
    case Level::kInfo: return "info";
    case Level::kWarn: return "warn";
    case Level::kError: return "error";
    case Level::kOff: break;
  }
  return "off";
}

Level level() {
  int now = current_level.load(std::memory_order_relaxed);
  if (now == kUnread) {
    // Two threads may both read the environment; they find the same value, and only the first
    // stores it (and a set_level in between wins).
    int expected = kUnread;
    const int read = static_cast<int>(read_environment());
    current_level.compare_exchange_strong(expected, read);
    now = current_level.load(std::memory_order_relaxed);
  }
  return static_cast<Level>(now);
}

void set_level(Level level) { current_level.store(static_cast<int>(level), std::memory_order_relaxed); }

void reset_level() { current_level.store(kUnread, std::memory_order_relaxed); }

bool enabled(Level level) { return level != Level::kOff && level >= log::level(); }

void write(Level level, std::string_view line) {
  if (!enabled(level)) return;
  logger().log(to_spdlog(level), spdlog::string_view_t(line.data(), line.size()));
}

}  // namespace shoal::log
