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

constexpr const char* kHeader = "{\"traceEvents\":[\n";
constexpr const char* kFooter = "\n],\"displayTimeUnit\":\"ms\"}\n";
constexpr std::streamoff kMaxPartBytes = std::streamoff(1) << 30;

// The process recorder of enable()/disable(): never destroyed (spans may end during static
// destruction), replaced by enable().
std::atomic<bool> g_enabled{false};
std::mutex g_process_mutex;
Recorder* g_process = nullptr;

Recorder& process_recorder() {
  std::lock_guard<std::mutex> lock(g_process_mutex);
  if (g_process == nullptr) g_process = new Recorder(0);
  return *g_process;
}

thread_local Recorder* t_recorder = nullptr;
thread_local bool t_recorder_set = false;

}  // namespace

/// Thread ids of the communication tracks: far above thread_number()'s small ones.
constexpr int64_t kCommTrackTid = 1'000'000;

struct Recorder::Impl {
  std::mutex mutex;
  std::atomic<int> rank{0};
  std::atomic<int64_t> epoch{-1};
  std::atomic<int64_t> step{-1};
  std::vector<std::string> events;
  struct Open {
    int64_t start_us;
    int64_t bytes;
    int64_t tid;  // the thread that began it: the flow arrow's tail
  };
  std::map<std::pair<std::string, int64_t>, Open> open;
  std::vector<int64_t> track_free_at;  // per communication track: when its last slice ended
  int64_t next_flow = 0;

  /// The first communication track free at `start` (a new one when none is), taken until `end`.
  /// Locked.
  int64_t take_track(int64_t start, int64_t end) {
    size_t track = 0;
    while (track < track_free_at.size() && track_free_at[track] > start) ++track;
    if (track == track_free_at.size()) {
      track_free_at.push_back(0);
      std::ostringstream meta;
      meta << "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" << rank.load()
           << ",\"tid\":" << kCommTrackTid + static_cast<int64_t>(track)
           << ",\"args\":{\"name\":\"communication" << (track ? " " + std::to_string(track + 1) : "")
           << "\"}}";
      events.push_back(meta.str());
    }
    track_free_at[track] = end;
    return kCommTrackTid + static_cast<int64_t>(track);
  }

  void add_metadata() {
    std::ostringstream meta;
    meta << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << rank.load()
         << ",\"args\":{\"name\":\"rank " << rank.load() << "\"}}";
    events.push_back(meta.str());
    std::ostringstream order;
    order << "{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":" << rank.load()
          << ",\"args\":{\"sort_index\":" << rank.load() << "}}";
    events.push_back(order.str());
  }
};

Recorder::Recorder(int rank) : impl_(std::make_unique<Impl>()) {
  impl_->rank = rank;
  impl_->add_metadata();
}

Recorder::~Recorder() = default;

int Recorder::rank() const { return impl_->rank.load(); }

namespace {

/// One complete ("X") event with integer args and the recorder's epoch and step.
std::string complete_event(const std::string& name, const char* category, int64_t start_us,
                           int64_t end_us, int rank, int64_t tid,
                           const std::vector<std::pair<std::string, int64_t>>& args, int64_t epoch,
                           int64_t step) {
  std::ostringstream event;
  event << "{\"name\":\"" << escape(name) << "\",\"cat\":\"" << escape(category)
        << "\",\"ph\":\"X\",\"ts\":" << start_us << ",\"dur\":" << std::max<int64_t>(0, end_us - start_us)
        << ",\"pid\":" << rank << ",\"tid\":" << tid;
  if (!args.empty() || step >= 0) {
    event << ",\"args\":{";
    const char* comma = "";
    for (const auto& [key, value] : args) {
      event << comma << "\"" << escape(key) << "\":" << value;
      comma = ",";
    }
    if (epoch >= 0) event << comma << "\"epoch\":" << epoch, comma = ",";
    if (step >= 0) event << comma << "\"step\":" << step;
    event << "}";
  }
  event << "}";
  return event.str();
}

}  // namespace

void Recorder::complete(const std::string& name, const char* category, int64_t start_us,
                        int64_t end_us, const std::vector<std::pair<std::string, int64_t>>& args) {
  std::string event = complete_event(name, category, start_us, end_us, impl_->rank.load(),
                                     thread_number(), args, impl_->epoch.load(), impl_->step.load());
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->events.push_back(std::move(event));
}

void Recorder::set_step(int64_t epoch, int64_t step) {
  impl_->epoch = epoch;
  impl_->step = step;
}

void Recorder::begin(const char* name, int64_t key, int64_t bytes) {
  const int64_t tid = thread_number();
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->open[{name, key}] = {now_us(), bytes, tid};
}

void Recorder::end(const char* name, int64_t key) {
  const int64_t now = now_us();
  std::lock_guard<std::mutex> lock(impl_->mutex);
  const auto found = impl_->open.find({name, key});
  if (found == impl_->open.end()) return;  // begun before recording started
  const Impl::Open begun = found->second;
  impl_->open.erase(found);
  std::vector<std::pair<std::string, int64_t>> args{{"bucket", key}};
  if (begun.bytes >= 0) args.emplace_back("bytes", begun.bytes);
  const int rank = impl_->rank.load();
  const int64_t track = impl_->take_track(begun.start_us, now);
  impl_->events.push_back(complete_event(std::string(name) + " bucket " + std::to_string(key),
                                         "comm", begun.start_us, now, rank, track, args,
                                         impl_->epoch.load(), impl_->step.load()));
  // The flow arrow: from the slice that made the bucket ready (backward, on the thread that
  // launched it) to the reduction's slice on its track; both ends bind to their enclosing slice.
  const int64_t flow = impl_->next_flow++;
  for (const auto& [phase, tid] : {std::pair<const char*, int64_t>{"s", begun.tid}, {"f", track}}) {
    std::ostringstream arrow;
    arrow << "{\"name\":\"bucket ready\",\"cat\":\"comm\",\"ph\":\"" << phase
          << "\",\"id\":" << flow << ",\"ts\":" << begun.start_us << ",\"pid\":" << rank
          << ",\"tid\":" << tid << (phase[0] == 'f' ? ",\"bp\":\"e\"" : "") << "}";
    impl_->events.push_back(arrow.str());
  }
}

void Recorder::restart(int rank) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->rank = rank;
  impl_->events.clear();
  impl_->open.clear();
  impl_->track_free_at.clear();
  impl_->add_metadata();
}

std::vector<std::string> Recorder::take_events() {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  std::vector<std::string> events;
  events.swap(impl_->events);
  impl_->track_free_at.clear();  // their names went with the events: named again on next use
  return events;
}

ScopedRecorder::ScopedRecorder(Recorder* recorder)
    : previous_(t_recorder), previous_set_(t_recorder_set) {
  t_recorder = recorder;
  t_recorder_set = true;
}

ScopedRecorder::~ScopedRecorder() {
  t_recorder = previous_;
  t_recorder_set = previous_set_;
}

Recorder* current() {
  if (t_recorder_set) return t_recorder;
  return g_enabled.load(std::memory_order_acquire) ? &process_recorder() : nullptr;
}

void enable(int rank) {
  process_recorder().restart(rank);
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
  if (Recorder* recorder = current()) recorder->complete(name, category, start_us, end_us, args);
}

void set_step(int64_t epoch, int64_t step) {
  if (Recorder* recorder = current()) recorder->set_step(epoch, step);
}

void begin(const char* name, int64_t key, int64_t bytes) {
  if (Recorder* recorder = current()) recorder->begin(name, key, bytes);
}

void end(const char* name, int64_t key) {
  if (Recorder* recorder = current()) recorder->end(name, key);
}

Span::Span(const char* name, const char* category)
    : name_(name), category_(category), recorder_(current()) {
  if (recorder_ != nullptr) start_us_ = now_us();
}

Span::~Span() {
  if (recorder_ != nullptr) recorder_->complete(name_, category_, start_us_, now_us());
}

std::vector<std::string> take_events() { return process_recorder().take_events(); }

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
