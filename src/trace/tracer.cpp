#include "shoal/trace/tracer.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "shoal/error.h"

namespace shoal::trace {
namespace {

struct State {
  std::mutex mutex;
  int rank = 0;
  std::vector<std::string> events;
  std::map<std::pair<std::string, int64_t>, std::pair<int64_t, int64_t>> open;  // start, bytes
};

std::atomic<bool> g_enabled{false};

State& state() {
  static State* s = new State();  // never destroyed: spans may end during static destruction
  return *s;
}

/// A small stable thread id for the trace's "tid" (std::thread::id has no portable number).
int64_t thread_number() {
  static std::atomic<int64_t> next{0};
  thread_local const int64_t id = next++;
  return id;
}

std::string escape(const std::string& text) {
  std::string out;
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char code[8];
      std::snprintf(code, sizeof(code), "\\u%04x", c);
      out += code;
    } else {
      out += c;
    }
  }
  return out;
}

void record(std::string event) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.events.push_back(std::move(event));
}

constexpr const char* kHeader = "{\"traceEvents\":[\n";
constexpr const char* kFooter = "\n],\"displayTimeUnit\":\"ms\"}\n";
constexpr std::streamoff kMaxPartBytes = std::streamoff(1) << 30;

}  // namespace

void enable(int rank) {
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.rank = rank;
    s.events.clear();
    s.open.clear();
    std::ostringstream meta;
    meta << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << rank
         << ",\"args\":{\"name\":\"rank " << rank << "\"}}";
    s.events.push_back(meta.str());
    std::ostringstream order;
    order << "{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":" << rank
          << ",\"args\":{\"sort_index\":" << rank << "}}";
    s.events.push_back(order.str());
  }
  g_enabled.store(true, std::memory_order_release);
}

void disable() { g_enabled.store(false, std::memory_order_release); }

bool enabled() { return g_enabled.load(std::memory_order_acquire); }

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void complete(const std::string& name, const char* category, int64_t start_us, int64_t end_us,
              const std::vector<std::pair<std::string, int64_t>>& args) {
  if (!enabled()) return;
  std::ostringstream event;
  event << "{\"name\":\"" << escape(name) << "\",\"cat\":\"" << escape(category)
        << "\",\"ph\":\"X\",\"ts\":" << start_us << ",\"dur\":" << std::max<int64_t>(0, end_us - start_us)
        << ",\"pid\":" << state().rank << ",\"tid\":" << thread_number();
  if (!args.empty()) {
    event << ",\"args\":{";
    for (size_t i = 0; i < args.size(); ++i) {
      event << (i ? "," : "") << "\"" << escape(args[i].first) << "\":" << args[i].second;
    }
    event << "}";
  }
  event << "}";
  record(event.str());
}

void begin(const char* name, int64_t key, int64_t bytes) {
  if (!enabled()) return;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.open[{name, key}] = {now_us(), bytes};
}

void end(const char* name, int64_t key) {
  if (!enabled()) return;
  const int64_t now = now_us();
  int64_t start = 0;
  int64_t bytes = -1;
  {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    const auto found = s.open.find({name, key});
    if (found == s.open.end()) return;  // begun before recording started
    start = found->second.first;
    bytes = found->second.second;
    s.open.erase(found);
  }
  std::vector<std::pair<std::string, int64_t>> args{{"bucket", key}};
  if (bytes >= 0) args.emplace_back("bytes", bytes);
  complete(std::string(name) + " bucket " + std::to_string(key), "comm", start, now, args);
}

Span::Span(const char* name, const char* category) : name_(name), category_(category) {
  if (enabled()) start_us_ = now_us();
}

Span::~Span() {
  if (start_us_ >= 0) complete(name_, category_, start_us_, now_us());
}

std::vector<std::string> take_events() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::vector<std::string> events;
  events.swap(s.events);
  return events;
}

void write_file(const std::string& path, const std::vector<std::string>& events) {
  const std::string temporary = path + ".tmp";
  {
    std::ofstream out(temporary, std::ios::trunc);
    SHOAL_CHECK(out.good(), "trace: cannot write ", temporary);
    out << kHeader;
    for (size_t i = 0; i < events.size(); ++i) out << (i ? ",\n" : "") << events[i];
    out << kFooter;
    out.flush();
    SHOAL_CHECK(out.good(), "trace: writing ", temporary, " failed (disk full?)");
  }
  SHOAL_CHECK(std::rename(temporary.c_str(), path.c_str()) == 0, "trace: cannot rename ",
              temporary, " to ", path);
}

void merge_files(const std::vector<std::string>& parts, const std::string& path) {
  std::vector<std::string> events;
  for (const std::string& part : parts) {
    std::ifstream in(part, std::ios::ate);
    SHOAL_CHECK(in.good(), "trace: cannot read ", part);
    SHOAL_CHECK(in.tellg() <= kMaxPartBytes, "trace: ", part, " is larger than 1 GiB");
    in.seekg(0);
    std::string line;
    std::getline(in, line);
    SHOAL_CHECK(line + "\n" == kHeader, "trace: ", part, " is not a trace part");
    while (std::getline(in, line)) {
      if (line.empty() || line[0] != '{') continue;  // the footer
      if (line.back() == ',') line.pop_back();
      events.push_back(line);
    }
  }
  write_file(path, events);
  for (const std::string& part : parts) std::remove(part.c_str());
}

}  // namespace shoal::trace
