#include "shoal/ps/server.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <mutex>
#include <set>
#include <thread>

#include "ps/auth.h"
#include "ps/zap_gate.h"
#include "log/rate_limiter.h"
#include "security/auth_token.h"
#include "shoal/checkpoint/serialization.h"
#include "ps/message.h"
#include "shoal/error.h"
#include "shoal/log.h"

namespace shoal::ps {
namespace {

using Clock = std::chrono::steady_clock;

// Why 50 ms: how often the loop looks at stop() and at silent workers when no message comes;
// short next to worker_timeout, long enough to cost nothing.
constexpr std::chrono::milliseconds kPollInterval{50};

struct Peer {
  int rank = -1;
  bool authenticated = false;
  bool challenged = false;
  Challenge challenge{};
};

struct WorkerState {
  bool finished = false;
  bool dead = false;
  int64_t completed = 0;  // pushes done (its clock)
  Clock::time_point last_seen;
  bool live() const { return !finished && !dead; }
};

struct Entry {
  at::Tensor value;  // flat float32
  int64_t offset = 0;
  int64_t numel = 0;
  int64_t version = 0;  // shard version of its last update
};

struct Pending {  // bsp: gradients of one clock being summed
  std::set<int> ranks;
  std::map<uint32_t, at::Tensor> sums;
  double lr_factor_sum = 0;  // the pushes' schedule factors (equal when the workers agree)
};

// Why 1e4: a schedule's factor scales the base learning rate; beyond that it only diverges, and
// a forged value must not reach the optimizer.
constexpr double kMaxLrFactor = 1e4;

// The learning-rate factor of a push (its blob); false when the blob is not one.
bool push_lr_factor(const std::string& blob, double* factor, std::string* why) {
  if (blob.size() != sizeof(double)) {
    *why = "push with a " + std::to_string(blob.size()) +
           "-byte blob, expected the 8-byte learning-rate factor";
    return false;
  }
  std::memcpy(factor, blob.data(), sizeof(double));
  if (!std::isfinite(*factor) || *factor < 0 || *factor > kMaxLrFactor) {
    *why = "push with learning-rate factor " + std::to_string(*factor) + ", expected one in [0, " +
           std::to_string(kMaxLrFactor) + "]";
    return false;
  }
  return true;
}

struct Deferred {
  std::string routing_id;
  Header request;
};

struct SumRound {
  std::map<int, std::vector<double>> values;
  std::vector<Deferred> waiting;
  bool checkpoint = false;  // a worker asked for the shard to be saved when the round completes
  int64_t step = -1;        // the step it is saved as
  std::string conflict;     // workers that named different steps
};

/// The step of "<base>.step<digits>.pt", or -1 for another name.
int64_t step_of(const std::string& name, const std::string& base) {
  const std::string head = base + ".step";
  if (name.size() <= head.size() + 3 || name.compare(0, head.size(), head) != 0 ||
      name.compare(name.size() - 3, 3, ".pt") != 0) {
    return -1;
  }
  const std::string digits = name.substr(head.size(), name.size() - head.size() - 3);
  if (digits.size() > 18 || digits.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoll(digits);
}

/// Deletes the step files of `prefix` after `current`, and the oldest beyond `keep` (0: none)
/// of those before it.
void rotate_step_files(const std::string& prefix, int64_t current, int keep) {
  const std::filesystem::path p(prefix);
  const std::string dir = p.has_parent_path() ? p.parent_path().string() : ".";
  const std::string base = p.filename().string();
  std::vector<std::pair<int64_t, std::string>> older;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const int64_t step = step_of(entry.path().filename().string(), base);
    if (step < 0 || step == current) continue;
    if (step > current) {
      std::filesystem::remove(entry.path(), ec);
    } else {
      older.emplace_back(step, entry.path().string());
    }
  }
  std::sort(older.begin(), older.end());
  const size_t kept_older = keep > 0 ? static_cast<size_t>(keep - 1) : older.size();
  for (size_t i = 0; i + kept_older < older.size(); ++i) {
    std::filesystem::remove(older[i].second, ec);
  }
}

}  // namespace

struct Server::Impl {
  ServerOptions options;
  Limits limits;
  zmq::context_t context{1};
  zmq::socket_t socket{context, zmq::socket_type::router};
  std::unique_ptr<ZapGate> gate;  // with a token: before the socket binds, gone before it closes
  // Lines about rejected messages and refused connections: at most 10 a second (a peer sending a
  // flood of bad messages does not flood the log), each saying how many were held back before it.
  log::RateLimiter reject_log{10};
  std::string endpoint;
  std::atomic<bool> stopping{false};
  std::thread thread;

  std::map<std::string, Peer> peers;
  std::vector<WorkerState> workers;
  std::map<uint32_t, Entry> shard;
  bool initialized = false;
  int64_t version = 0;
  int64_t bsp_applied = 0;  // bsp: steps applied
  std::map<int64_t, Pending> pending;
  std::vector<Deferred> deferred_pulls;
  std::map<int64_t, SumRound> sum_rounds;

  mutable std::mutex stats_mutex;
  ServerStats stats;
  Server* owner = nullptr;
  int64_t last_checkpoint_updates = 0;

  std::string name() const {
    return "[ps server " + std::to_string(options.rank) + " " + consistency_name(options.consistency) +
           "]";
  }

  void log(const std::string& line) const {
    // --verbose shows these at the default level; SHOAL_LOG_LEVEL=debug shows them always.
    const log::Level level = options.verbose ? log::Level::kInfo : log::Level::kDebug;
    if (log::enabled(level)) log::write(level, name() + " " + line);
  }

  void reply(const std::string& to, MessageType type, const Header& request, std::string blob = {}) {
    OutMessage out(type, options.rank, request.seq);
    out.blob = std::move(blob);
    send_message(socket, to, out);
  }

  void reply_error(const std::string& to, const Header& request, const std::string& what) {
    reply(to, MessageType::kError, request, name() + " " + what);
  }

  void reject(const std::string& to, const std::string& why, bool answer, const Header* request) {
    {
      std::lock_guard<std::mutex> lock(stats_mutex);
      ++stats.rejected;
    }
    const auto found = peers.find(to);
    const std::string who =
        found != peers.end() && found->second.rank >= 0
            ? "worker " + std::to_string(found->second.rank)
            : "an unidentified peer";
    if (int64_t held = 0; reject_log.allow(&held)) {
      log("rejected a message from " + who + ": " + why + reject_log.held_note(held));
    }
    if (answer && request != nullptr) reply_error(to, *request, "rejected: " + why);
  }

  // The slowest live worker's finished clocks; max when none is live.
  int64_t min_live_clock() const {
    int64_t result = std::numeric_limits<int64_t>::max();
    for (const WorkerState& w : workers) {
      if (w.live()) result = std::min(result, w.completed);
    }
    return result;
  }

  int live_workers() const {
    int n = 0;
    for (const WorkerState& w : workers) n += w.live() ? 1 : 0;
    return n;
  }

  std::string dead_list() const {
    std::string out;
    for (int r : stats.dead_workers) out += (out.empty() ? "" : ", ") + std::to_string(r);
    return out;
  }

  // ---- handlers ---------------------------------------------------------------------------------

  void on_hello(InMessage& m) {
    const int rank = m.header.rank;
    if (rank < 0 || rank >= options.num_workers) {
      reject(m.routing_id, "hello from rank " + std::to_string(rank) + ", but the job has " +
                               std::to_string(options.num_workers) + " workers",
             true, &m.header);
      return;
    }
    Peer& peer = peers[m.routing_id];
    peer.rank = rank;
    if (options.auth_token.empty()) {
      peer.authenticated = true;
      reply(m.routing_id, MessageType::kWelcome, m.header);
      return;
    }
    peer.challenge = make_challenge();
    peer.challenged = true;
    reply(m.routing_id, MessageType::kChallenge, m.header,
          std::string(reinterpret_cast<const char*>(peer.challenge.data()), peer.challenge.size()));
  }

  void on_auth(InMessage& m) {
    auto found = peers.find(m.routing_id);
    Digest answer{};
    const bool well_formed = m.blob.size() == answer.size();
    if (well_formed) std::memcpy(answer.data(), m.blob.data(), answer.size());
    if (found == peers.end() || !found->second.challenged || !well_formed ||
        !check_auth_response(options.auth_token, found->second.challenge, answer)) {
      {
        std::lock_guard<std::mutex> lock(stats_mutex);
        ++stats.auth_failures;
      }
      reject(m.routing_id, "authentication failed (wrong or missing SHOAL_AUTH_TOKEN)", true,
             &m.header);
      peers.erase(m.routing_id);
      return;
    }
    found->second.authenticated = true;
    found->second.challenged = false;
    reply(m.routing_id, MessageType::kWelcome, m.header);
  }

  // Checks every key of a message against the shard; returns what is wrong, or empty.
  std::string check_keys(const InMessage& m) const {
    for (const KeyRange& k : m.keys) {
      const auto found = shard.find(k.key);
      if (found == shard.end()) return "key " + std::to_string(k.key) + " is not on this server";
      if (found->second.offset != k.offset || found->second.numel != k.numel) {
        return "key " + std::to_string(k.key) + " range [" + std::to_string(k.offset) + ", +" +
               std::to_string(k.numel) + ") does not match this server's [" +
               std::to_string(found->second.offset) + ", +" + std::to_string(found->second.numel) +
               ")";
      }
    }
    return {};
  }

  void on_init(InMessage& m, int rank) {
    if (!initialized) {
      for (size_t i = 0; i < m.keys.size(); ++i) {
        Entry entry;
        entry.value = m.tensor(i).clone();
        entry.offset = m.keys[i].offset;
        entry.numel = m.keys[i].numel;
        shard[m.keys[i].key] = std::move(entry);
      }
      initialized = true;
      log("initialized by worker " + std::to_string(rank) + ": " + std::to_string(shard.size()) +
          " key ranges");
    }
    reply(m.routing_id, MessageType::kOk, m.header);
    serve_deferred();
  }

  void record_staleness(int64_t clock) {
    const int64_t slowest = min_live_clock();
    const int64_t staleness =
        slowest == std::numeric_limits<int64_t>::max() ? 0 : std::max<int64_t>(0, clock - slowest);
    std::lock_guard<std::mutex> lock(stats_mutex);
    ++stats.pushes;
    stats.max_staleness = std::max(stats.max_staleness, staleness);
    ++stats.staleness_counts[staleness];
  }

  void apply(uint32_t key, const at::Tensor& grad, double lr_factor) {
    Entry& entry = shard.at(key);
    options.optimizer->step(key, entry.value, grad, lr_factor);
    entry.version = version;
  }

  void on_push(InMessage& m, int rank) {
    if (!initialized) {
      reject(m.routing_id, "push before any worker initialized the parameters", true, &m.header);
      return;
    }
    const std::string bad = check_keys(m);
    if (!bad.empty()) {
      reject(m.routing_id, "push: " + bad, true, &m.header);
      return;
    }
    double lr_factor = 1;
    std::string why;
    if (!push_lr_factor(m.blob, &lr_factor, &why)) {
      reject(m.routing_id, why, true, &m.header);
      return;
    }
    WorkerState& worker = workers[static_cast<size_t>(rank)];
    const int64_t clock = m.header.clock;
    if (clock != worker.completed) {
      reject(m.routing_id, "push of clock " + std::to_string(clock) + " from worker " +
                               std::to_string(rank) + ", expected clock " +
                               std::to_string(worker.completed),
             true, &m.header);
      return;
    }
    record_staleness(clock);
    if (options.consistency == Consistency::kBsp) {
      Pending& step = pending[clock];
      for (size_t i = 0; i < m.keys.size(); ++i) {
        auto found = step.sums.find(m.keys[i].key);
        if (found == step.sums.end()) {
          step.sums.emplace(m.keys[i].key, m.tensor(i).clone());
        } else {
          found->second.add_(m.tensor(i));
        }
      }
      step.ranks.insert(rank);
      step.lr_factor_sum += lr_factor;
    } else {
      // Each push counts as 1/W of a step, so that one round of W pushes moves the weights as
      // far as one bsp step (the mean gradient) and the same learning rate serves every mode.
      ++version;
      const double scale = 1.0 / options.num_workers;
      for (size_t i = 0; i < m.keys.size(); ++i) {
        apply(m.keys[i].key, m.tensor(i).mul(scale), lr_factor);
      }
      std::lock_guard<std::mutex> lock(stats_mutex);
      ++stats.updates;
    }
    worker.completed = clock + 1;
    reply(m.routing_id, MessageType::kOk, m.header);
    complete_bsp_steps();
    serve_deferred();
  }

  // bsp: applies every step all workers have pushed, in order, once each (the mean gradient).
  void complete_bsp_steps() {
    // A dead worker's gradient is missing for good: bsp stops (pulls are answered with an error).
    if (options.consistency != Consistency::kBsp || !stats.dead_workers.empty()) return;
    while (true) {
      auto found = pending.find(bsp_applied);
      if (found == pending.end()) return;
      // Every live worker must have pushed; one that said goodbye no longer holds steps back.
      for (size_t r = 0; r < workers.size(); ++r) {
        if (workers[r].live() && found->second.ranks.count(static_cast<int>(r)) == 0) return;
      }
      ++version;
      const double scale = 1.0 / static_cast<double>(found->second.ranks.size());
      const double lr_factor = found->second.lr_factor_sum * scale;
      for (auto& [key, sum] : found->second.sums) apply(key, sum.mul_(scale), lr_factor);
      pending.erase(found);
      ++bsp_applied;
      std::lock_guard<std::mutex> lock(stats_mutex);
      ++stats.updates;
    }
  }

  // Whether a pull by a worker that finished `clock` clocks may be answered now; an error when it
  // never can.
  bool pull_ready(int64_t clock, std::string* error) const {
    if (!initialized) return false;
    switch (options.consistency) {
      case Consistency::kAsp:
        return true;
      case Consistency::kSsp:
        return min_live_clock() >= clock - options.staleness;
      case Consistency::kBsp:
        if (bsp_applied >= clock) return true;
        if (!stats.dead_workers.empty()) {
          *error = "bsp step " + std::to_string(clock - 1) +
                   " cannot complete: worker(s) " + dead_list() +
                   " presumed dead (nothing heard for " +
                   std::to_string(options.worker_timeout.count()) + " ms)";
        }
        return false;
    }
    return false;
  }

  void answer_pull(const Deferred& pull) {
    OutMessage out(MessageType::kParams, options.rank, pull.request.seq);
    out.header.version = version;
    for (const auto& [key, entry] : shard) {
      if (entry.version <= pull.request.version && pull.request.version >= 0) continue;
      KeyRange range;
      range.key = key;
      range.offset = entry.offset;
      range.numel = entry.numel;
      out.keys.push_back(range);
      // A snapshot: the optimizer changes the values in place while libzmq may still be sending.
      out.tensors.push_back(entry.value.clone());
    }
    send_message(socket, pull.routing_id, out);
  }

  // Answers `pull` (with parameters, or an error when it can never be served); false when it
  // must wait.
  bool try_answer(const Deferred& pull) {
    std::string error;
    if (pull_ready(pull.request.clock, &error)) {
      answer_pull(pull);
    } else if (!error.empty()) {
      reply_error(pull.routing_id, pull.request, error);
    } else {
      return false;
    }
    return true;
  }

  void on_pull(InMessage& m) {
    Deferred pull{m.routing_id, m.header};
    if (try_answer(pull)) return;
    deferred_pulls.push_back(std::move(pull));
    if (!initialized) return;  // waiting for rank 0's weights is not a consistency hold-up
    std::lock_guard<std::mutex> lock(stats_mutex);
    ++stats.deferred_pulls;
  }

  void serve_deferred() {
    std::vector<Deferred> still;
    for (Deferred& pull : deferred_pulls) {
      if (!try_answer(pull)) still.push_back(std::move(pull));
    }
    deferred_pulls = std::move(still);
    serve_sums();
  }

  void on_sum(InMessage& m, int rank) {
    if (m.blob.size() % sizeof(double) != 0) {
      reject(m.routing_id, "sum of " + std::to_string(m.blob.size()) + " bytes", true, &m.header);
      return;
    }
    SumRound& round = sum_rounds[m.header.clock];
    std::vector<double> values;
    if (m.header.version == 1) {
      // A checkpoint barrier: the blob is the step, not values to sum.
      int64_t step = 0;
      if (m.blob.size() != sizeof(step)) {
        reject(m.routing_id, "checkpoint barrier of " + std::to_string(m.blob.size()) + " bytes",
               true, &m.header);
        return;
      }
      std::memcpy(&step, m.blob.data(), sizeof(step));
      if (round.checkpoint && round.step != step && round.conflict.empty()) {
        round.conflict = "workers asked for the checkpoint of step " + std::to_string(round.step) +
                         " and of step " + std::to_string(step) + " in one barrier";
      }
      round.checkpoint = true;
      round.step = step;
    } else {
      values.resize(m.blob.size() / sizeof(double));
      if (!values.empty()) std::memcpy(values.data(), m.blob.data(), m.blob.size());
    }
    round.values[rank] = std::move(values);
    round.waiting.push_back({m.routing_id, m.header});
    serve_sums();
  }

  // Answers every round all live workers have contributed to.
  void serve_sums() {
    for (auto it = sum_rounds.begin(); it != sum_rounds.end();) {
      SumRound& round = it->second;
      bool complete = true;
      for (size_t r = 0; r < workers.size(); ++r) {
        if (workers[r].live() && round.values.count(static_cast<int>(r)) == 0) complete = false;
      }
      if (!complete || round.values.empty()) {
        ++it;
        continue;
      }
      std::vector<double> sums;
      for (const auto& [rank, values] : round.values) {
        if (sums.size() < values.size()) sums.resize(values.size(), 0.0);
        for (size_t i = 0; i < values.size(); ++i) sums[i] += values[i];
      }
      const std::string blob(reinterpret_cast<const char*>(sums.data()),
                             sums.size() * sizeof(double));
      // Every live worker waits here, its pushes applied: the shard is the state they all see.
      std::string failed = round.conflict;
      if (failed.empty() && round.checkpoint && saves_checkpoints() && initialized) {
        try {
          save_checkpoint(round.step);
        } catch (const std::exception& e) {
          failed = std::string("saving the shard failed: ") + e.what();
        }
      }
      if (!failed.empty()) log(failed);
      for (const Deferred& w : round.waiting) {
        if (failed.empty()) {
          reply(w.routing_id, MessageType::kSumResult, w.request, blob);
        } else {
          reply_error(w.routing_id, w.request, failed);
        }
      }
      it = sum_rounds.erase(it);
    }
  }

  void on_bye(InMessage& m, int rank) {
    WorkerState& worker = workers[static_cast<size_t>(rank)];
    if (!worker.finished) {
      worker.finished = true;
      std::lock_guard<std::mutex> lock(stats_mutex);
      stats.finished_workers.push_back(rank);
    }
    reply(m.routing_id, MessageType::kOk, m.header);
    complete_bsp_steps();
    serve_deferred();
  }

  // A worker is presumed dead when it has been silent for worker_timeout and has no request
  // waiting here (a worker held back by ssp/bsp is silent because of us, not dead).
  void check_silent_workers() {
    const Clock::time_point now = Clock::now();
    std::set<std::string> waiting_ids;
    for (const Deferred& pull : deferred_pulls) waiting_ids.insert(pull.routing_id);
    for (const auto& [round, state] : sum_rounds) {
      for (const Deferred& w : state.waiting) waiting_ids.insert(w.routing_id);
    }
    std::set<int> waiting_ranks;
    for (const std::string& id : waiting_ids) {
      const auto found = peers.find(id);
      if (found != peers.end()) waiting_ranks.insert(found->second.rank);
    }
    bool changed = false;
    for (size_t r = 0; r < workers.size(); ++r) {
      WorkerState& w = workers[r];
      if (waiting_ranks.count(static_cast<int>(r)) > 0) {
        w.last_seen = now;  // silent because it waits for us: its silence starts when answered
        continue;
      }
      if (!w.live()) continue;
      if (now - w.last_seen < options.worker_timeout) continue;
      w.dead = true;
      changed = true;
      {
        std::lock_guard<std::mutex> lock(stats_mutex);
        stats.dead_workers.push_back(static_cast<int>(r));
      }
      log("worker " + std::to_string(r) + " presumed dead: nothing heard for " +
          std::to_string(options.worker_timeout.count()) + " ms at clock " +
          std::to_string(w.completed) +
          (options.consistency == Consistency::kBsp
               ? "; bsp cannot go on without it"
               : "; training goes on with " + std::to_string(live_workers()) + " worker(s)"));
    }
    if (changed) serve_deferred();
  }

  void handle(InMessage& m) {
    const MessageType type = m.type();
    if (type == MessageType::kHello) {
      on_hello(m);
      return;
    }
    if (type == MessageType::kAuth) {
      on_auth(m);
      return;
    }
    const auto found = peers.find(m.routing_id);
    if (found == peers.end() || !found->second.authenticated) {
      reject(m.routing_id, std::string(message_type_name(type)) + " before authentication",
             true, &m.header);
      return;
    }
    const int rank = found->second.rank;
    if (m.header.rank != rank) {
      reject(m.routing_id, "message claims rank " + std::to_string(m.header.rank) +
                               " on worker " + std::to_string(rank) + "'s connection",
             true, &m.header);
      return;
    }
    WorkerState& worker = workers[static_cast<size_t>(rank)];
    worker.last_seen = Clock::now();
    if (worker.dead && options.consistency != Consistency::kBsp) {
      // Slow, not dead: under asp/ssp it simply rejoins (bsp has already failed its step).
      worker.dead = false;
      {
        std::lock_guard<std::mutex> lock(stats_mutex);
        auto& dead = stats.dead_workers;
        dead.erase(std::remove(dead.begin(), dead.end(), rank), dead.end());
      }
      log("worker " + std::to_string(rank) + " was presumed dead but spoke again; it rejoins");
    }
    switch (type) {
      case MessageType::kInit: on_init(m, rank); return;
      case MessageType::kPush: on_push(m, rank); return;
      case MessageType::kPull: on_pull(m); return;
      case MessageType::kSum: on_sum(m, rank); return;
      case MessageType::kBye: on_bye(m, rank); return;
      default:
        reject(m.routing_id, std::string("unexpected ") + message_type_name(type) + " message",
               true, &m.header);
    }
  }

  bool saves_checkpoints() const {
    return !options.checkpoint_path.empty() || !options.step_checkpoint_prefix.empty();
  }

  /// Saves the shard: at a checkpoint barrier of `step` to its step file when there is a prefix,
  /// else (and at step -1, outside barriers) to checkpoint_path when set.
  void save_checkpoint(int64_t step = -1) {
    const bool by_step = step >= 0 && !options.step_checkpoint_prefix.empty();
    if (!by_step && options.checkpoint_path.empty()) return;
    checkpoint::StateDict state;
    for (auto& [name, tensor] : owner->shard_state()) state.insert(name, tensor);
    if (step >= 0) state.insert(kStepKey, at::scalar_tensor(step, at::kLong));
    if (!by_step) {
      checkpoint::save_state_dict(state, options.checkpoint_path);
      return;
    }
    checkpoint::save_state_dict(state, step_checkpoint_path(options.step_checkpoint_prefix, step));
    rotate_step_files(options.step_checkpoint_prefix, step, options.step_checkpoint_keep);
  }

  void maybe_checkpoint() {
    if (options.checkpoint_path.empty() || options.checkpoint_every <= 0) return;
    if (stats.updates > 0 && stats.updates % options.checkpoint_every == 0 &&
        stats.updates != last_checkpoint_updates) {
      last_checkpoint_updates = stats.updates;
      save_checkpoint();
    }
  }

  bool all_done() const {
    for (const WorkerState& w : workers) {
      if (w.live()) return false;
    }
    return true;
  }

  void run() {
    const Clock::time_point start = Clock::now();
    for (WorkerState& w : workers) w.last_seen = start;
    while (!stopping.load() && !all_done()) {
      ReceiveResult got = receive_message(socket, kPollInterval, limits, /*router=*/true);
      if (got.message) {
        handle(*got.message);
      } else if (!got.error.empty()) {
        Header none;
        reject(got.routing_id, got.error, false, &none);
      }
      check_silent_workers();
      maybe_checkpoint();
    }
    if (!options.checkpoint_path.empty() && initialized) save_checkpoint();
  }
};

Server::Server(ServerOptions options) : impl_(std::make_unique<Impl>()) {
  SHOAL_CHECK_T(InvalidArgument, options.num_workers >= 1, "ps server: num_workers must be >= 1");
  SHOAL_CHECK_T(InvalidArgument, options.staleness >= 0, "ps server: staleness must be >= 0");
  if (options.auth_token_from_env && options.auth_token.empty()) {
    options.auth_token = auth_token_from_env();
  }
  // Its own copy: two servers of one process stepping one optimizer raced on its state.
  options.optimizer = options.optimizer ? std::shared_ptr<ShardOptimizer>(options.optimizer->clone())
                                        : std::make_shared<Sgd>(SgdOptions{});
  impl_->limits.max_message_bytes = options.max_message_bytes;
  impl_->options = std::move(options);
  impl_->workers.resize(static_cast<size_t>(impl_->options.num_workers));
  configure_socket(impl_->socket, impl_->limits);
  if (!impl_->options.auth_token.empty()) {
    // The gate first: a connection must present the token's gate password in ZeroMQ's handshake
    // before the server reads any message of it (auth.h).
    Impl* impl = impl_.get();
    impl_->gate = std::make_unique<ZapGate>(
        impl_->context, gate_password(impl_->options.auth_token), [impl](const std::string& address) {
          {
            std::lock_guard<std::mutex> lock(impl->stats_mutex);
            ++impl->stats.gate_refusals;
          }
          if (int64_t held = 0; impl->reject_log.allow(&held)) {
            impl->log("refused a connection from " + address +
                      " in ZeroMQ's handshake: it does not know the job's token (SHOAL_AUTH_TOKEN)" +
                      impl->reject_log.held_note(held));
          }
        });
    impl_->socket.set(zmq::sockopt::plain_server, 1);
    impl_->socket.set(zmq::sockopt::zap_domain, ZapGate::kDomain);
    // A connection that has not passed the gate within this is closed (libzmq's default: 30 s).
    impl_->socket.set(zmq::sockopt::handshake_ivl,
                      static_cast<int>(security::kHandshakeTimeout.count()));
  }
  try {
    impl_->socket.bind(impl_->options.bind);
  } catch (const zmq::error_t& e) {
    SHOAL_THROW(Error, impl_->name(), " cannot bind ", impl_->options.bind, ": ", e.what());
  }
  impl_->endpoint = impl_->socket.get(zmq::sockopt::last_endpoint);
  impl_->owner = this;
  if (!impl_->options.restore_path.empty()) {
    std::map<std::string, at::Tensor> state;
    for (const auto& item : checkpoint::load_state_dict_file(impl_->options.restore_path)) {
      state[item.key()] = item.value();
    }
    if (impl_->options.restore_step >= 0) check_restored_step(state);
    load_shard_state(state);
    impl_->log("restored " + std::to_string(impl_->shard.size()) + " key ranges from " +
               impl_->options.restore_path);
  }
}

void Server::check_restored_step(const std::map<std::string, at::Tensor>& state) const {
  const std::string& path = impl_->options.restore_path;
  const int64_t want = impl_->options.restore_step;
  const auto it = state.find(kStepKey);
  SHOAL_CHECK_T(CheckpointError, it != state.end(), path, ": holds no step ('", kStepKey,
                "'), so it cannot be tied to the workers' checkpoint of step ", want,
                ": the file is damaged or from another job");
  const at::Tensor& t = it->second;
  SHOAL_CHECK_T(CheckpointError, t.numel() == 1 && !t.is_floating_point() && !t.is_complex(), path,
                ": '", kStepKey, "' is not one integer: the file is damaged");
  const int64_t got = t.item<int64_t>();
  SHOAL_CHECK_T(CheckpointError, got == want, path, ": holds the shard of step ", got,
                ", the workers resume from step ", want,
                ": the server's and the workers' checkpoints are of two steps; put back the "
                "server file of step ", want, " or resume from an older checkpoint");
}

std::string step_checkpoint_path(const std::string& prefix, int64_t step) {
  return prefix + ".step" + std::to_string(step) + ".pt";
}

Server::~Server() {
  stop();
  join();
  impl_->gate.reset();  // its callback uses members declared after it
}

std::string Server::endpoint() const { return impl_->endpoint; }

void Server::run() { impl_->run(); }

void Server::start() {
  SHOAL_CHECK(!impl_->thread.joinable(), "ps server: already started");
  impl_->thread = std::thread([this] { impl_->run(); });
}

void Server::join() {
  if (impl_->thread.joinable()) impl_->thread.join();
}

void Server::stop() { impl_->stopping.store(true); }

ServerStats Server::stats() const {
  std::lock_guard<std::mutex> lock(impl_->stats_mutex);
  return impl_->stats;
}

std::map<std::string, at::Tensor> Server::shard_state() const {
  std::map<std::string, at::Tensor> state;
  for (const auto& [key, entry] : impl_->shard) {
    const std::string name = std::to_string(key);
    state[name] = entry.value.clone();
    state["__meta__." + name] = at::tensor({entry.offset, entry.numel}, at::kLong);
    for (const auto& [what, tensor] : impl_->options.optimizer->state(key)) {
      state[name + "." + what] = tensor.clone();
    }
  }
  return state;
}

void Server::load_shard_state(const std::map<std::string, at::Tensor>& state) {
  for (const auto& [name, tensor] : state) {
    if (name.rfind("__meta__.", 0) != 0) continue;
    const std::string key_name = name.substr(9);
    const auto key = static_cast<uint32_t>(std::stoul(key_name));
    const auto value = state.find(key_name);
    SHOAL_CHECK_T(CheckpointError, value != state.end() && tensor.numel() == 2,
                  impl_->name(), " shard state: key ", key_name, " has no values");
    // The shard is float32: a saved shard of another kind (int, bool, complex) is refused by name,
    // another width named, as when a model loads a state dict.
    const std::string where = impl_->name() + " shard state: key " + key_name;
    if (checkpoint::check_dtype_change(value->second.scalar_type(), at::kFloat, where)) {
      log::warn("shoal: ", where, " is cast from ", checkpoint::dtype_name(value->second.scalar_type()),
                " to float32");
    }
    Entry entry;
    entry.value = value->second.to(at::kFloat).contiguous().view(-1).clone();
    entry.offset = tensor[0].item<int64_t>();
    entry.numel = tensor[1].item<int64_t>();
    SHOAL_CHECK_T(CheckpointError, entry.value.numel() == entry.numel, impl_->name(),
                  " shard state: key ", key_name, " has ", entry.value.numel(),
                  " values for a range of ", entry.numel);
    std::map<std::string, at::Tensor> optimizer_state;
    const std::string prefix = key_name + ".";
    for (const auto& [other, t] : state) {
      if (other.rfind(prefix, 0) != 0) continue;
      if (checkpoint::check_dtype_change(t.scalar_type(), at::kFloat, where + ": " + other)) {
        log::warn("shoal: ", where, ": ", other, " is cast from ", checkpoint::dtype_name(t.scalar_type()),
                  " to float32");
      }
      optimizer_state[other.substr(prefix.size())] = t;
    }
    impl_->options.optimizer->load_state(key, optimizer_state);
    impl_->shard[key] = std::move(entry);
  }
  impl_->initialized = !impl_->shard.empty();
}

}  // namespace shoal::ps
