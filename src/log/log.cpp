#include "shoal/log.h"

#include <spdlog/logger.h>
#include <spdlog/sinks/stdout_sinks.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>

#include "log/error_file.h"
#include "shoal/env.h"

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
  const std::optional<std::string> text = env::text(env::Var::kLogLevel);
  if (!text) return Level::kInfo;
  if (const auto parsed = parse_level(*text)) return *parsed;
  logger().log(spdlog::level::warn,
               "shoal: warning: SHOAL_LOG_LEVEL={} is not one of debug, info, warn, error, off; "
               "using info", *text);
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

// ---- error files (error_file.h) -------------------------------------------------------------

namespace shoal::log {
namespace {

std::atomic<int64_t> failed_at_us{0};  // 0: no failure noted

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (const unsigned char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char code[8];
      std::snprintf(code, sizeof(code), "\\u%04x", c);
      out += code;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

constexpr const char* kStampKey = "\"timestamp_us\": ";

}  // namespace

int64_t epoch_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void note_failure() {
  int64_t none = 0;
  failed_at_us.compare_exchange_strong(none, epoch_us());
}

void write_error_file(const std::string& message) {
  const char* path = std::getenv(kErrorFileEnv);
  if (path == nullptr || *path == '\0') return;
  note_failure();  // no earlier note: now
  const int64_t at = failed_at_us.load();
  // torchelastic's layout (its "timestamp" in seconds), with the microseconds beside it.
  std::ofstream out(path, std::ios::trunc);
  out << "{\"message\": {\"message\": " << json_string(message)
      << ", \"extraInfo\": {\"py_callstack\": " << json_string(message) << ", \"timestamp\": \""
      << at / 1000000 << "\", " << kStampKey << at << "}}}\n";
}

std::optional<ErrorFile> read_error_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  const std::string content = text.str();
  const size_t stamp = content.find(kStampKey);
  if (stamp == std::string::npos) return std::nullopt;
  ErrorFile file;
  const char* digits = content.c_str() + stamp + std::char_traits<char>::length(kStampKey);
  char* end = nullptr;
  file.time_us = std::strtoll(digits, &end, 10);
  if (end == digits) return std::nullopt;
  // The message: the JSON string after the first "message": {"message": , as written above.
  const std::string key = "{\"message\": {\"message\": \"";
  if (content.rfind(key, 0) != 0) return file;
  for (size_t i = key.size(); i < content.size() && content[i] != '"'; ++i) {
    if (content[i] != '\\' || i + 1 >= content.size()) {
      file.message += content[i];
    } else if (content[++i] == 'u' && i + 4 < content.size()) {
      file.message += static_cast<char>(std::strtol(content.substr(i + 1, 4).c_str(), nullptr, 16));
      i += 4;
    } else {
      file.message += content[i];
    }
  }
  return file;
}

}  // namespace shoal::log
