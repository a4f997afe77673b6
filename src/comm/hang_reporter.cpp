#include "comm/hang_reporter.h"

#include <future>
#include <thread>

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "comm/timeouts.h"
#include "shoal/error.h"

namespace shoal::comm {
namespace {

using Clock = std::chrono::steady_clock;

// The reporters of this process, answered by one thread. Never destroyed: groups may go away
// during static destruction.
struct Answerer {
  std::mutex mutex;
  std::vector<std::weak_ptr<HangReporter>> reporters;
  bool started = false;
};

Answerer*& answerer() {
  static Answerer* instance = new Answerer();
  return instance;
}

// A child of fork() has none of the parent's threads: it starts its own answerer when it makes a
// group (the parent's state, perhaps copied with the mutex held, is left behind).
void after_fork_in_child() { answerer() = new Answerer(); }

std::vector<std::shared_ptr<HangReporter>> live_reporters() {
  std::vector<std::shared_ptr<HangReporter>> live;
  Answerer* a = answerer();
  std::lock_guard<std::mutex> lock(a->mutex);
  auto& list = a->reporters;
  list.erase(std::remove_if(list.begin(), list.end(), [](auto& w) { return w.expired(); }),
             list.end());
  for (auto& w : list) {
    if (auto r = w.lock()) live.push_back(std::move(r));
  }
  return live;
}

void drop_reporter(const std::shared_ptr<HangReporter>& reporter) {
  Answerer* a = answerer();
  std::lock_guard<std::mutex> lock(a->mutex);
  auto& list = a->reporters;
  list.erase(std::remove_if(list.begin(), list.end(),
                            [&](auto& w) { return w.lock() == reporter; }),
             list.end());
}

using BeatCounter = std::pair<Store*, std::string>;

// One beat for the reporters that share `counter`; then their watches, and their answers when the
// beat's high bits say somebody asked since the last beat (`asked`: the count seen then).
void beat(const BeatCounter& counter, const std::vector<std::shared_ptr<HangReporter>>& reporters,
          int64_t& asked) {
  int64_t value = 0;
  try {
    value = counter.first->add(counter.second, 1);
  } catch (...) {
    for (const auto& r : reporters) drop_reporter(r);  // the store is gone: nobody can ask
    return;
  }
  const bool new_request = value / kRequestUnit != asked;
  asked = value / kRequestUnit;
  for (const auto& r : reporters) {
    if (!r->watch() || (new_request && !r->answer())) drop_reporter(r);
  }
}

void answer_loop() {
  std::map<BeatCounter, int64_t> asked;
  for (;;) {
    std::this_thread::sleep_for(beat_interval());
    // Store requests outside the answerer's lock: a store that hangs delays only this thread.
    std::map<BeatCounter, std::vector<std::shared_ptr<HangReporter>>> by_counter;
    for (auto& r : live_reporters()) by_counter[{r->store().get(), r->beat_key()}].push_back(r);
    for (const auto& [counter, reporters] : by_counter) beat(counter, reporters, asked[counter]);
  }
}

void add_reporter(const std::shared_ptr<HangReporter>& reporter) {
  static const int registered = pthread_atfork(nullptr, nullptr, after_fork_in_child);
  (void)registered;
  Answerer* a = answerer();
  std::lock_guard<std::mutex> lock(a->mutex);
  a->reporters.push_back(reporter);
  if (!a->started) {
    a->started = true;
    std::thread(answer_loop).detach();
  }
}

struct Report {
  bool present = false;
  int64_t request = 0;
  RankSummary summary;
};

// "<request> <last started> <last completed>\n<text>"
Report decode(const std::string& value) {
  Report report;
  unsigned long long request = 0, started = 0, completed = 0;
  int used = 0;
  if (std::sscanf(value.c_str(), "%llu %llu %llu\n%n", &request, &started, &completed, &used) < 3) {
    return report;
  }
  report.present = true;
  report.request = static_cast<int64_t>(request);
  report.summary.last_started = started;
  report.summary.last_completed = completed;
  report.summary.text = value.substr(static_cast<size_t>(used));
  return report;
}

// "<rank> <milliseconds silent>", as a watcher publishes the silent rank it found.
std::string encode_silence(const Silence& s) {
  return std::to_string(s.rank) + " " + std::to_string(s.silent_for.count());
}

std::optional<Silence> decode_silence(const std::string& value) {
  long long rank = -1, ms = 0;
  if (std::sscanf(value.c_str(), "%lld %lld", &rank, &ms) != 2 || rank < 0) return std::nullopt;
  return Silence{static_cast<int>(rank), Milliseconds(ms)};
}

// Reads the reports still missing from `reports` that answer `request`'s incident.
void read_reports(Store& store, const std::vector<std::string>& report_keys, int64_t request,
                  std::vector<Report>& reports) {
  const int size = static_cast<int>(reports.size());
  std::vector<int> waiting;
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) {
    if (reports[r].present) continue;
    waiting.push_back(r);
    keys.push_back(report_keys[r]);
  }
  if (keys.empty()) return;
  // Every member published a placeholder when its group formed, so one batched read is the rule;
  // reading key by key is for a member whose placeholder a store restart or a deletion lost.
  std::vector<std::string> values;
  if (store.check(keys)) {
    for (auto& v : store.multi_get(keys)) values.emplace_back(v.begin(), v.end());
  } else {
    for (const std::string& key : keys) {
      values.push_back(store.check({key}) ? store.get_string(key) : std::string());
    }
  }
  for (size_t i = 0; i < waiting.size(); ++i) {
    Report theirs = decode(values[i]);
    // Answers to this request, or to another rank's request of the same incident: each rank asks
    // once, so one incident's requests are at most size consecutive numbers (a rank that asked
    // first and has already exited answered only its own).
    if (theirs.present && theirs.request > request - size) reports[waiting[i]] = std::move(theirs);
  }
}

// Asks the ranks still missing from `reports` through their beat counters, unless another rank of
// the incident does: "<scope>/hang/asked" holds the request of the last rank that asked, and of
// the ranks that find it older than their incident, the one that first claims it asks.
void ask(Store& store, const std::string& scope, const std::vector<std::string>& beat_keys,
         int64_t request, const std::vector<Report>& reports) {
  const int64_t size = static_cast<int64_t>(reports.size());
  const int64_t last = store.add(scope + "/hang/asked", 0);
  if (last > 0 && last > request - size) return;  // a rank of this incident has asked
  if (store.add(scope + "/hang/asking/" + std::to_string(last), 1) != 1) return;
  for (size_t r = 0; r < reports.size(); ++r) {
    if (!reports[r].present) store.add(beat_keys[r], kRequestUnit);
  }
  store.add(scope + "/hang/asked", request - last);
}

}  // namespace

Milliseconds beat_interval() {
  return std::clamp(silent_peer_timeout() / 4, Milliseconds(250), Milliseconds(1000));
}

std::shared_ptr<HangReporter> HangReporter::create(std::shared_ptr<Store> store, std::string scope,
                                                   int rank, int size, Summarize summarize,
                                                   std::vector<int> job_ranks) {
  SHOAL_CHECK(job_ranks.empty() || static_cast<int>(job_ranks.size()) == size,
              "HangReporter: ", job_ranks.size(), " job ranks for a group of ", size);
  std::shared_ptr<HangReporter> reporter(new HangReporter(
      std::move(store), std::move(scope), rank, size, std::move(summarize), std::move(job_ranks)));
  if (size > 1) {
    // A placeholder, so that a report is one batched read of keys that all exist.
    reporter->store_->set_string(reporter->report_key(rank), "");
    add_reporter(reporter);
  }
  return reporter;
}

HangReporter::HangReporter(std::shared_ptr<Store> store, std::string scope, int rank, int size,
                           Summarize summarize, std::vector<int> job_ranks)
    : store_(std::move(store)),
      scope_(std::move(scope)),
      rank_(rank),
      size_(size),
      job_ranks_(std::move(job_ranks)),
      summarize_(std::move(summarize)) {
  if (job_ranks_.empty()) {
    for (int r = 0; r < size; ++r) job_ranks_.push_back(r);
  }
  for (int job_rank : job_ranks_) beat_keys_.push_back("shoal/beat/" + std::to_string(job_rank));
}

int HangReporter::job_rank(int rank) const { return job_ranks_[rank]; }

HangReporter::~HangReporter() = default;

void HangReporter::close() {
  std::lock_guard<std::mutex> lock(summarize_mutex_);
  closed_ = true;
  summarize_ = nullptr;
}

std::string HangReporter::encode(int64_t request) {
  std::lock_guard<std::mutex> lock(summarize_mutex_);
  if (closed_) return "";
  const RankSummary mine = summarize_();
  return std::to_string(request) + " " + std::to_string(mine.last_started) + " " +
         std::to_string(mine.last_completed) + "\n" + mine.text;
}

bool HangReporter::answer() {
  try {
    const int64_t request = store_->add(scope_ + "/hang/request", 0);
    if (request <= answered_) return true;
    const std::string value = encode(request);
    if (value.empty()) return false;  // closed: its group is going away
    store_->set_string(report_key(rank_), value);
    answered_ = request;
    return true;
  } catch (...) {
    return false;  // the store is gone (rank 0 exited): nobody can ask any more
  }
}

std::vector<int> HangReporter::watched_ranks() const {
  std::vector<int> ranks;
  for (int i = 1; i <= std::min(kWatchedSuccessors, size_ - 1); ++i) {
    ranks.push_back((rank_ + i) % size_);
  }
  return ranks;
}

bool HangReporter::watch() {
  uint64_t sequence = 0;
  std::optional<Silence> publish;
  {
    std::lock_guard<std::mutex> lock(beats_mutex_);
    if (Clock::now() >= watch_until_) return true;  // nobody is waiting long
    sequence = watched_sequence_;
    if (!published_) publish = publish_;
  }
  const std::string silent_key = scope_ + "/silent/" + std::to_string(sequence);
  const std::vector<int> ranks = watched_ranks();
  std::vector<int64_t> beat(ranks.size(), 0);
  std::optional<Silence> found;
  try {
    if (publish) store_->set_string(silent_key, encode_silence(*publish));
    for (size_t i = 0; i < ranks.size(); ++i) {
      beat[i] = store_->add(beat_keys_[ranks[i]], 0) % kRequestUnit;
    }
    if (store_->check({silent_key})) found = decode_silence(store_->get_string(silent_key));
  } catch (...) {
    return false;  // the store is gone: silent_ranks() reports the store's silence
  }
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(beats_mutex_);
  if (sequence != watched_sequence_) return true;  // a new watch began meanwhile
  if (publish) published_ = true;
  if (found && found->rank != rank_) found_ = found;
  if (beat_.empty()) {
    beat_ = std::move(beat);
    moved_at_.assign(ranks.size(), now);
  } else {
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (beat[i] != beat_[i]) {
        beat_[i] = beat[i];
        moved_at_[i] = now;
      }
    }
  }
  last_reading_ = now;
  return true;
}

std::vector<Silence> HangReporter::silent_ranks(Milliseconds limit, uint64_t sequence) {
  std::lock_guard<std::mutex> lock(beats_mutex_);
  const auto now = Clock::now();
  if (now >= watch_until_ || sequence != watched_sequence_) {
    // A new watch: what an earlier one saw is out of date.
    last_reading_ = now;  // the watch's store silence counts from here
    watched_sequence_ = sequence;
    beat_.clear();
    moved_at_.clear();
    found_.reset();
    publish_.reset();
    published_ = false;
  }
  watch_until_ = now + 4 * beat_interval();
  if (found_) return {*found_};
  const auto since_reading = std::chrono::duration_cast<Milliseconds>(now - last_reading_);
  if (since_reading >= limit) {
    // The answering thread has not completed a reading for that long: its store calls hang.
    return {{-1, since_reading}};
  }
  std::vector<Silence> silent;
  const std::vector<int> ranks = watched_ranks();
  for (size_t i = 0; i < moved_at_.size() && i < ranks.size(); ++i) {
    const auto still = std::chrono::duration_cast<Milliseconds>(now - moved_at_[i]);
    if (still >= limit) silent.push_back({ranks[i], still});
  }
  if (!silent.empty() && !publish_) publish_ = silent.front();  // for the other waiters
  return silent;
}

std::string HangReporter::gather(Milliseconds budget) {
  auto answer = std::make_shared<std::promise<std::string>>();
  std::future<std::string> table = answer->get_future();
  std::thread([self = shared_from_this(), budget, answer] {
    answer->set_value(self->gather_through_store(budget));
  }).detach();
  if (table.wait_for(budget + kHangStoreSlack) == std::future_status::ready) return table.get();
  char line[160];
  std::snprintf(line, sizeof line,
                "\nevery rank's last operations: the store did not answer within %.1f s (is its "
                "host, rank 0's, cut off?)",
                std::chrono::duration<double>(budget + kHangStoreSlack).count());
  return line;
}

std::string HangReporter::report_key(int rank) const {
  return scope_ + "/hang/" + std::to_string(rank);
}

std::string HangReporter::gather_through_store(Milliseconds budget) {
  const auto start = Clock::now();
  const auto deadline = start + budget;
  std::vector<Report> reports(size_);
  try {
    const int64_t request = store_->add(scope_ + "/hang/request", 1);
    const std::string mine = encode(request);
    if (mine.empty()) return "";
    store_->set_string(report_key(rank_), mine);
    reports[rank_] = decode(mine);
    std::vector<std::string> report_keys;
    for (int r = 0; r < size_; ++r) report_keys.push_back(report_key(r));
    auto pause = Milliseconds(5);
    int64_t published = request;
    bool asked = false;
    for (;;) {
      // Another rank may have asked since: answer it too (this rank's answering thread may have
      // answered it already and been overwritten by the publication above).
      if (const int64_t newest = store_->add(scope_ + "/hang/request", 0); newest > published) {
        const std::string again = encode(newest);
        if (!again.empty()) store_->set_string(report_key(rank_), again);
        published = newest;
      }
      read_reports(*store_, report_keys, request, reports);
      const bool complete = std::all_of(reports.begin(), reports.end(),
                                        [](const Report& r) { return r.present; });
      if (complete || Clock::now() + pause > deadline) break;
      // The ranks that failed with this one answer by themselves; the others are asked through
      // their beat counters, by one rank of the incident, once they had kAskGrace to answer.
      if (!asked && Clock::now() - start >= kAskGrace) {
        ask(*store_, scope_, beat_keys_, request, reports);
        asked = true;
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, kReportPollCap);
    }
  } catch (...) {
    // The store is gone or failing: report what was gathered, if anything.
  }
  uint64_t newest = 0;
  for (const Report& r : reports) {
    if (r.present) newest = std::max(newest, r.summary.last_started);
  }
  const double took = std::chrono::duration<double>(Clock::now() - start).count();
  char header[128];
  std::snprintf(header, sizeof header,
                "\nevery rank's last operations (gathered through the store in %.1f s):", took);
  std::string out = header;
  for (int r = 0; r < size_; ++r) {
    out += "\n  rank " + std::to_string(r) + ": ";
    if (!reports[r].present) {
      out += "no report (dead or stopped?)";
      continue;
    }
    out += reports[r].summary.text;
    if (reports[r].summary.last_started < newest) out += "  <- behind";
  }
  return out;
}

}  // namespace shoal::comm
