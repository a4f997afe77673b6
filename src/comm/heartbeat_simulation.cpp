#include "comm/heartbeat_simulation.h"

#include <sys/resource.h>

#include <algorithm>
#include <string>
#include <utility>

#include "comm/tcp_store.h"
#include "security/auth_token.h"
#include "shoal/error.h"

namespace shoal::comm {
namespace {

// A store client that counts the requests sent through it.
class CountingStore : public Store {
 public:
  CountingStore(std::shared_ptr<Store> base, std::atomic<int64_t>& count)
      : base_(std::move(base)), count_(count) {}
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    ++count_;
    base_->set(key, value);
  }
  std::vector<uint8_t> get(const std::string& key) override {
    ++count_;
    return base_->get(key);
  }
  int64_t add(const std::string& key, int64_t delta) override {
    ++count_;
    return base_->add(key, delta);
  }
  bool check(const std::vector<std::string>& keys) override {
    ++count_;
    return base_->check(keys);
  }
  void wait(const std::vector<std::string>& keys, Milliseconds timeout) override {
    ++count_;
    base_->wait(keys, timeout);
  }
  bool delete_key(const std::string& key) override {
    ++count_;
    return base_->delete_key(key);
  }
  std::vector<std::vector<uint8_t>> multi_get(const std::vector<std::string>& keys) override {
    ++count_;
    return base_->multi_get(keys);
  }
  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::vector<uint8_t>>& values) override {
    ++count_;
    base_->multi_set(keys, values);
  }
  Milliseconds timeout() const override { return base_->timeout(); }
  void set_timeout(Milliseconds timeout) override { base_->set_timeout(timeout); }

 private:
  std::shared_ptr<Store> base_;
  std::atomic<int64_t>& count_;
};

void raise_open_file_limit(int ranks) {
  rlimit limit{};
  SHOAL_CHECK(getrlimit(RLIMIT_NOFILE, &limit) == 0, "getrlimit(RLIMIT_NOFILE) failed");
  const rlim_t needed = 2 * static_cast<rlim_t>(ranks) + 64;
  if (limit.rlim_cur < needed && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = std::min(limit.rlim_max, std::max(needed, limit.rlim_cur));
    setrlimit(RLIMIT_NOFILE, &limit);
    getrlimit(RLIMIT_NOFILE, &limit);
  }
  SHOAL_CHECK_T(InvalidArgument, limit.rlim_cur >= needed, "simulating ", ranks,
                " ranks needs ", needed, " open files; the limit is ", limit.rlim_cur,
                " (raise it with ulimit -n)");
}

constexpr Milliseconds kStoreTimeout{120'000};

}  // namespace

HeartbeatSimulation::HeartbeatSimulation(int ranks, int groups)
    : named_(ranks), stopped_(ranks) {
  SHOAL_CHECK_T(InvalidArgument, ranks > 1 && groups > 0, "a simulated job needs 2 or more ranks "
                "and a group");
  raise_open_file_limit(ranks);
  for (auto& n : named_) n = kNone;
  for (auto& s : stopped_) s = false;
  const std::string token = security::token_from_env();
  auto server = std::make_shared<TcpStore>("127.0.0.1", 0, true, token, kStoreTimeout);
  const int port = server->port();
  server_ = server;
  reporters_.resize(ranks);
  for (int r = 0; r < ranks; ++r) {
    auto client = std::make_shared<CountingStore>(
        std::make_shared<TcpStore>("127.0.0.1", port, false, token, kStoreTimeout), requests_);
    for (int g = 0; g < groups; ++g) {
      reporters_[r].push_back(HangReporter::create(
          client, "sim/g" + std::to_string(g), r, ranks,
          [] { return RankSummary{0, 0, "no operation yet"}; }));
    }
  }
}

HeartbeatSimulation::~HeartbeatSimulation() {
  stop_waiting();
  for (auto& groups : reporters_) {
    for (auto& reporter : groups) reporter->close();
  }
}


int64_t HeartbeatSimulation::beats(int rank) {
  return server_->add("shoal/beat/" + std::to_string(rank), 0) % kRequestUnit;
}

void HeartbeatSimulation::start_waiting(int busy, uint64_t sequence, Milliseconds limit) {
  stop_waiting();
  waiting_ = true;
  waiter_ = std::thread([this, busy, sequence, limit] {
    while (waiting_) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        for (int r = 0; r < ranks(); ++r) {
          if (r == busy || stopped_[r] || named_[r] != kNone) continue;
          const auto silent = reporters_[r][0]->silent_ranks(limit, sequence);
          if (!silent.empty()) named_[r] = silent.front().rank;
        }
      }
      std::this_thread::sleep_for(kHangPollInterval);
    }
  });
}

int HeartbeatSimulation::named(int rank) const { return named_[rank]; }

int HeartbeatSimulation::naming() const {
  int count = 0;
  for (const auto& n : named_) count += n != kNone;
  return count;
}

void HeartbeatSimulation::stop_waiting() {
  waiting_ = false;
  if (waiter_.joinable()) waiter_.join();
}

std::vector<std::string> HeartbeatSimulation::gather_all(Milliseconds budget) {
  std::vector<std::string> tables(ranks());
  std::vector<std::thread> askers;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int r = 0; r < ranks(); ++r) {
      if (stopped_[r]) continue;
      askers.emplace_back([&tables, reporter = reporters_[r][0], r, budget] {
        tables[r] = reporter->gather(budget);
      });
    }
  }
  for (auto& t : askers) t.join();
  return tables;
}

std::string HeartbeatSimulation::gather(int rank, Milliseconds budget) {
  std::shared_ptr<HangReporter> reporter;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    SHOAL_CHECK(!stopped_[rank], "simulated rank ", rank, " is stopped and cannot ask");
    reporter = reporters_[rank][0];
  }
  return reporter->gather(budget);
}

void HeartbeatSimulation::stop(int rank) {
  std::lock_guard<std::mutex> lock(mutex_);  // the waiting thread is not reading them
  stopped_[rank] = true;
  for (auto& reporter : reporters_[rank]) reporter->close();
  reporters_[rank].clear();  // the answering thread holds them only weakly: the beats stop
}

}  // namespace shoal::comm
