#include "shoal/parallel/fault_tolerant_manager.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <functional>
#include <optional>
#include <sstream>

#include "comm/hang_reporter.h"
#include "comm/timeouts.h"
#include "shoal/comm/init.h"
#include "shoal/comm/process_group.h"
#include "shoal/comm/store.h"
#include "shoal/error.h"
#include "shoal/log.h"

namespace shoal::parallel {
namespace {

std::string member_list_text(const std::vector<int>& ranks) {
  std::ostringstream text;
  for (size_t i = 0; i < ranks.size(); ++i) text << (i ? "," : "") << ranks[i];
  return text.str();
}

// Ranks as the store's decisions carry them: "rank" or, for a replacement, "rank:incarnation".
struct Member {
  int rank = 0;
  int64_t incarnation = 0;
};

// A count the store holds (a join's incarnation): digits only, below 2^31.
int64_t parse_count(const std::string& text, const std::string& key) {
  const bool digits = !text.empty() && text.size() <= 10 &&
                      text.find_first_not_of("0123456789") == std::string::npos;
  SHOAL_CHECK_T(PeerError, digits && std::stoll(text) < (int64_t{1} << 31),
                "fault tolerance: the store's '", key, "' holds '", text.substr(0, 40),
                "', not a count: is another job using this store (its address and port)?");
  return std::stoll(text);
}

// "rank[:incarnation],...", each rank one of the job's `world_size`.
std::vector<Member> parse_member_list(const std::string& text, int world_size,
                                      const std::string& key) {
  std::vector<Member> members;
  std::istringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (item.empty()) continue;
    const size_t colon = item.find(':');
    const int64_t rank = parse_count(item.substr(0, colon), key);
    SHOAL_CHECK_T(PeerError, rank < world_size && members.size() < static_cast<size_t>(world_size),
                  "fault tolerance: the store's '", key, "' names rank ", rank, " of a job of ",
                  world_size, " ranks: is another job using this store?");
    members.push_back({static_cast<int>(rank), colon == std::string::npos
                                                   ? 0
                                                   : parse_count(item.substr(colon + 1), key)});
  }
  return members;
}

std::string join_key(int rank) { return "ft/join/" + std::to_string(rank); }
std::string admitted_key(int rank, int64_t incarnation) {
  return "ft/admitted/" + std::to_string(rank) + "/" + std::to_string(incarnation);
}
std::string formed_key(int rank, int64_t incarnation) {
  return "ft/formed/" + std::to_string(rank) + "/" + std::to_string(incarnation);
}
constexpr const char* kFinishedKey = "ft/finished";
// Replacements that asked to join and were not admitted yet: a joiner adds 1 after its join key,
// the step that admits it takes 1 off, so a member learns with one request that one waits.
constexpr const char* kWaitingJoinsKey = "ft/joins_waiting";

// The step's tally (step_key("tally")), one counter that every replica adds to once: 1 for an ok
// vote, kFailedVote for a failed one; a replica that stops waiting adds kClosed too.
constexpr int64_t kFailedVote = int64_t{1} << 20;  // above any count of replicas
constexpr int64_t kClosed = int64_t{1} << 40;
constexpr int64_t kFieldMask = kFailedVote - 1;

int64_t ok_votes(int64_t tally) { return tally & kFieldMask; }
int64_t failed_votes(int64_t tally) { return (tally / kFailedVote) & kFieldMask; }
bool failed_or_closed(int64_t tally) { return tally >= kFailedVote; }

bool contains(const std::vector<int>& ranks, int rank) {
  return std::find(ranks.begin(), ranks.end(), rank) != ranks.end();
}

using Clock = std::chrono::steady_clock;

// The members' heartbeats as one wait sees them: a rank is silent once its counter has not moved
// for `limit` since the wait first read it. The counters are read at most once a beat interval,
// so a long wait costs a request per member and beat, not per slice.
class BeatWatch {
 public:
  BeatWatch(comm::Store& store, const std::vector<int>& ranks)
      : store_(store), ranks_(ranks), limit_(comm::silent_peer_timeout()) {}

  bool silent(int rank) {
    const auto now = Clock::now();
    if (now >= next_read_) {
      for (int r : ranks_) {
        const int64_t beats = store_.add(FaultTolerantManager::heartbeat_key(r), 0);
        auto [seen, first] = seen_.try_emplace(r, Seen{beats, now});
        if (!first && seen->second.beats != beats) seen->second = {beats, now};
      }
      next_read_ = now + comm::beat_interval();
    }
    const auto seen = seen_.find(rank);
    return seen != seen_.end() && now - seen->second.moved_at >= limit_;
  }

 private:
  struct Seen {
    int64_t beats = 0;
    Clock::time_point moved_at;
  };
  comm::Store& store_;
  std::vector<int> ranks_;
  comm::Milliseconds limit_;
  Clock::time_point next_read_{};
  std::map<int, Seen> seen_;
};

// Waits until every key of `keys` is in `store`, in slices of `slice` (the store answers the
// moment the last arrives; the slice bounds how late `stop` is noticed): true when they are;
// false once `stop` holds between slices or `give_up` has passed.
bool wait_for_keys(comm::Store& store, const std::vector<std::string>& keys,
                   comm::Milliseconds slice, Clock::time_point give_up,
                   const std::function<bool()>& stop) {
  while (true) {
    try {
      store.wait(keys, slice);
      return true;
    } catch (const TimeoutError&) {
    }
    if (stop() || Clock::now() >= give_up) return false;
  }
}

}  // namespace

FaultTolerantManager::FaultTolerantManager(std::shared_ptr<comm::Store> store, int rank,
                                           int world_size, FaultTolerantOptions options)
    : store_(std::move(store)), rank_(rank), options_(std::move(options)), world_size_(world_size) {
  SHOAL_CHECK_T(InvalidArgument, store_ != nullptr, "FaultTolerantManager: no store given");
  SHOAL_CHECK_T(InvalidArgument, rank >= 0 && rank < world_size, "FaultTolerantManager: rank ",
                rank, " is not in 0..", world_size - 1);
  SHOAL_CHECK_T(InvalidArgument, options_.min_replicas >= 1 && options_.min_replicas <= world_size,
                "--min-replicas ", options_.min_replicas, " must be in 1..", world_size,
                " (the job's replicas)");
  heartbeat_ = std::thread([this] { beat(); });
  try {
    incarnation_ = store_->add(exit_key(rank_), 0);
    if (incarnation_ > 0) {
      join();
      return;
    }
    members_ = founders();
    form_group();
  } catch (...) {
    stop_beating();
    throw;
  }
}

FaultTolerantManager::~FaultTolerantManager() {
  stop_beating();
  if (std::uncaught_exceptions() > 0) return;
  try {
    store_->set_string(kFinishedKey, "1");
  } catch (const std::exception&) {
    // The store is gone with the job: no replacement is left to tell.
  }
}

// The heartbeat thread: one store request a beat until stop_beating(), or until the store is
// gone with the job (then this replica cannot vote either).
void FaultTolerantManager::beat() {
  std::unique_lock<std::mutex> lock(beat_mutex_);
  while (beating_) {
    lock.unlock();
    try {
      store_->add(FaultTolerantManager::heartbeat_key(rank_), 1);
    } catch (const std::exception&) {
      return;
    }
    lock.lock();
    beat_stop_.wait_for(lock, comm::beat_interval(), [&] { return !beating_; });
  }
}

void FaultTolerantManager::stop_beating() {
  {
    std::lock_guard<std::mutex> lock(beat_mutex_);
    beating_ = false;
  }
  beat_stop_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
}

int FaultTolerantManager::replica_rank() const {
  return static_cast<int>(std::find(members_.begin(), members_.end(), rank_) - members_.begin());
}

int FaultTolerantManager::donor_replica_rank() const {
  return static_cast<int>(std::find(members_.begin(), members_.end(), donor_) - members_.begin());
}

int64_t FaultTolerantManager::incarnation_of(int rank) const {
  const auto found = incarnations_.find(rank);
  return found == incarnations_.end() ? 0 : found->second;
}

std::string FaultTolerantManager::step_key(const std::string& what) const {
  return "ft/g" + std::to_string(generation_) + "/s" + std::to_string(attempt_) + "/" + what;
}

std::string FaultTolerantManager::wire_list(const std::vector<int>& ranks) const {
  std::ostringstream text;
  for (size_t i = 0; i < ranks.size(); ++i) {
    text << (i ? "," : "") << ranks[i];
    if (incarnation_of(ranks[i]) > 0) text << ":" << incarnation_of(ranks[i]);
  }
  return text.str();
}

void FaultTolerantManager::form_group() {
  auto prefix = comm::make_prefix_store("ft/g" + std::to_string(generation_) + "/pg", store_);
  group_ = comm::new_process_group(options_.backend, prefix, replica_rank(), num_replicas(),
                                   options_.timeout);
}

// A replacement: asks to join, and waits until the members form the generation that admits it.
void FaultTolerantManager::join() {
  store_->set_string(join_key(rank_), std::to_string(incarnation_));
  store_->add(kWaitingJoinsKey, 1);
  log::warn("[rank ", rank_, "] fault tolerance: a replacement (restart ", incarnation_,
            " of this rank) asks to join the job's replicas");
  const std::string formed = formed_key(rank_, incarnation_);
  const auto finished = [&] { return store_->check({kFinishedKey}); };
  if (!wait_for_keys(*store_, {formed}, comm::Milliseconds(200),
                     Clock::now() + options_.join_timeout, finished)) {
    SHOAL_CHECK_T(PeerError, !finished(), "[rank ", rank_,
                  "] fault tolerance: the job's replicas finished before this replacement could "
                  "join; nothing is left to train");
    SHOAL_THROW(TimeoutError, "[rank ", rank_, "] fault tolerance: not admitted to the job's "
                "replicas within ", options_.join_timeout.count(), " ms (", formed,
                "): are the others training?");
  }
  // "<generation> <donor's job rank> <members>"
  std::istringstream in(store_->get_string(formed));
  std::string members;
  in >> generation_ >> donor_ >> members;
  for (const Member& m : parse_member_list(members, world_size_, formed)) {
    members_.push_back(m.rank);
    if (m.incarnation > 0) incarnations_[m.rank] = m.incarnation;
  }
  SHOAL_CHECK_T(PeerError, in && contains(members_, rank_) && contains(members_, donor_),
                "[rank ", rank_, "] fault tolerance: malformed admission '",
                store_->get_string(formed), "' under ", formed);
  joined_ = {rank_};
  log::warn("[rank ", rank_, "] fault tolerance: joins generation ", generation_, " with ",
            members_.size(), " replicas (ranks ", member_list_text(members_), ")");
  form_group();
}

void FaultTolerantManager::start_quorum(bool admit) {
  joined_.clear();
  const bool grow = admit && !pending_joiners_.empty();
  if (next_members_.empty() && !grow) return;
  std::vector<int> next = next_members_.empty() ? members_ : std::move(next_members_);
  next_members_.clear();
  SHOAL_CHECK_T(PeerError, contains(next, rank_), "[rank ", rank_,
                "] left out of the job's replicas after step ", attempt_, " of generation ",
                generation_,
                " failed: its vote did not come in time (was it stopped?); the job goes on without it");
  if (grow) {
    for (int r : pending_joiners_) {
      if (!contains(next, r)) joined_.push_back(r);
    }
    next.insert(next.end(), joined_.begin(), joined_.end());
    std::sort(next.begin(), next.end());
    pending_joiners_.clear();
  }
  SHOAL_CHECK_T(InvalidArgument, static_cast<int>(next.size()) >= options_.min_replicas,
                "[rank ", rank_, "] ", next.size(), " replica", next.size() == 1 ? "" : "s",
                " left (ranks ", member_list_text(next), "), fewer than --min-replicas ",
                options_.min_replicas, ": the job cannot go on; lower --min-replicas or restart it");
  re_form(std::move(next));
}

void FaultTolerantManager::re_form(std::vector<int> members) {
  group_.reset();
  // The donor: the first member that holds the state (was a member before).
  for (int r : members) {
    if (contains(members_, r)) {
      donor_ = r;
      break;
    }
  }
  members_ = std::move(members);
  ++generation_;
  attempt_ = 0;
  log::warn("[rank ", rank_, "] fault tolerance: generation ", generation_, " goes on with ",
            members_.size(), members_.size() == 1 ? " replica" : " replicas", " (ranks ",
            member_list_text(members_), ")");
  for (int r : joined_) {
    store_->set_string(formed_key(r, incarnation_of(r)), std::to_string(generation_) + " " +
                                                            std::to_string(donor_) + " " +
                                                            wire_list(members_));
  }
  form_group();
}

void FaultTolerantManager::allreduce(at::Tensor& tensor) {
  if (!group_) {
    step_ok_ = false;
    return;
  }
  try {
    group_->allreduce(tensor)->wait();
  } catch (const std::exception& e) {
    log::warn("[rank ", rank_, "] fault tolerance: step ", attempt_, " of generation ",
              generation_, " failed: ", e.what());
    step_ok_ = false;
    // Of no further use (the backend abandons a failed group, connections and all): a member
    // still blocked on this rank in this collective fails at its time-out.
    group_.reset();
  }
}

bool FaultTolerantManager::should_commit(bool admit) {
  const bool ok = step_ok_;
  step_ok_ = true;
  joins_counted_ = 0;
  std::optional<std::string> decision;
  if (ok) decision = tally_ok_vote(admit);
  if (!decision) decision = decide_slowly(ok, admit);
  return apply(*decision);
}

// Takes on the step's decision: true for a commit; the joiners it admits join at the next
// start_quorum(true), and a failed step's voters form the next generation.
bool FaultTolerantManager::apply(const std::string& decision) {
  const std::string key = step_key("decision");  // names the step in a parse error
  ++attempt_;
  // "commit" or the members that voted, then ";" and the joiners it admits, if any.
  const size_t semicolon = decision.find(';');
  if (semicolon != std::string::npos) {
    for (const Member& m : parse_member_list(decision.substr(semicolon + 1), world_size_, key)) {
      incarnations_[m.rank] = m.incarnation;
      pending_joiners_.push_back(m.rank);
    }
  }
  const std::string head = decision.substr(0, semicolon);
  if (head == "commit") return true;
  ++failed_steps_;
  for (const Member& m : parse_member_list(head, world_size_, key)) next_members_.push_back(m.rank);
  return false;
}


// The common case: the vote that completes the tally (exactly the members' count, nothing failed
// or closed before it) knows every member voted ok, and publishes "commit" (with the joiners
// waiting, under `admit`) as the step's decision, through the ticket as the slow way does; the
// others wait for the decision. Three or four store requests a replica. nullopt when the step must
// be settled by decide_slowly().
std::optional<std::string> FaultTolerantManager::tally_ok_vote(bool admit) {
  const int64_t tally = store_->add(step_key("tally"), 1);
  if (tally == num_replicas()) return publish_or_read(with_joiners("commit", admit));
  if (failed_or_closed(tally) || !await_decision()) return std::nullopt;
  return store_->get_string(step_key("decision"));
}

// Waits for the step's decision; false once a member has exited or stopped beating, a vote
// failed or the tally closed, or the wait is past timeout + quorum_grace.
bool FaultTolerantManager::await_decision() const {
  const auto give_up = Clock::now() + options_.timeout + options_.quorum_grace;
  BeatWatch beats(*store_, members_);
  return wait_for_keys(*store_, {step_key("decision")}, comm::Milliseconds(50), give_up, [&] {
    return failed_or_closed(store_->add(step_key("tally"), 0)) ||
           std::any_of(members_.begin(), members_.end(),
                       [&](int m) { return exited(m) || beats.silent(m); });
  });
}

// After a failure, or a missing or late vote: closes the tally (a vote after this cannot complete
// it), weighs the votes, and publishes its verdict unless another replica's came first. Whoever
// publishes first, every replica reads that one decision; a verdict of commit is right whenever
// it is given, as it needs every member's ok vote.
std::string FaultTolerantManager::decide_slowly(bool ok, bool admit) {
  if (!ok) store_->add(step_key("tally"), kFailedVote);
  store_->set_string(step_key("vote/" + std::to_string(rank_)), ok ? "1" : "0");
  const int64_t tally = store_->add(step_key("tally"), kClosed) - kClosed;
  const bool all_ok = ok_votes(tally) == num_replicas() && failed_votes(tally) == 0;
  // The ticket comes after the weighing, so a replica killed while it waits for the votes (the
  // long part) holds up no one.
  return publish_or_read(decide(all_ok, admit));
}

// The step's decision: `verdict` when this replica takes the step's ticket (the first), which
// then publishes it and marks the joiners it admits as admitted (a later step does not admit them
// again); otherwise the ticket holder's, waited for.
std::string FaultTolerantManager::publish_or_read(const std::string& verdict) {
  const std::string decision_key = step_key("decision");
  if (store_->add(step_key("ticket"), 1) != 1) {
    store_->wait({decision_key}, options_.timeout + options_.quorum_grace);
    return store_->get_string(decision_key);
  }
  const size_t semicolon = verdict.find(';');
  if (semicolon != std::string::npos) {
    const std::string joiners = verdict.substr(semicolon + 1);
    for (const Member& m : parse_member_list(joiners, world_size_, decision_key)) {
      store_->set_string(admitted_key(m.rank, m.incarnation), "1");
    }
  }
  // Every request counted before the scan was admitted, or its asker has exited since.
  if (joins_counted_ > 0) store_->add(kWaitingJoinsKey, -joins_counted_);
  store_->set_string(decision_key, verdict);
  return verdict;
}

std::string FaultTolerantManager::exit_key(int rank) { return "ft/exited/" + std::to_string(rank); }

std::string FaultTolerantManager::founders_key() { return "ft/founders"; }

std::string FaultTolerantManager::heartbeat_key(int rank) {
  return "ft/beat/" + std::to_string(rank);
}

// Generation 0's members: the ranks the launcher names as starting the job, or all of them.
std::vector<int> FaultTolerantManager::founders() const {
  std::vector<int> ranks;
  if (!store_->check({founders_key()})) {
    for (int r = 0; r < world_size_; ++r) ranks.push_back(r);
    return ranks;
  }
  for (const Member& m : parse_member_list(store_->get_string(founders_key()), world_size_,
                                           founders_key())) {
    ranks.push_back(m.rank);
  }
  SHOAL_CHECK_T(PeerError, contains(ranks, rank_), "[rank ", rank_,
                "] fault tolerance: not among the ranks that start the job (", founders_key(), ": ",
                member_list_text(ranks), ") and not started as a replacement: was its node's "
                "shoal run started twice?");
  return ranks;
}

// Whether member `rank` exited since this incarnation of it started (a replacement's
// predecessor's exit does not count).
bool FaultTolerantManager::exited(int rank) const {
  return store_->add(exit_key(rank), 0) > incarnation_of(rank);
}

// Waits until every member voted, exited or stopped beating, or for timeout + quorum_grace; true
// when all voted.
bool FaultTolerantManager::await_votes(const std::vector<std::string>& votes) const {
  const auto give_up = Clock::now() + options_.timeout + options_.quorum_grace;
  BeatWatch beats(*store_, members_);
  return wait_for_keys(*store_, votes, comm::Milliseconds(200), give_up, [&] {
    for (size_t i = 0; i < votes.size(); ++i) {
      if (!store_->check({votes[i]}) && !exited(members_[i]) && !beats.silent(members_[i])) {
        return false;
      }
    }
    return true;  // settled: every member voted, exited or stopped beating
  });
}

// This member's verdict on the current step: "commit" (at once when the tally showed every vote
// ok: `all_ok`), or the members that voted; with `admit`, then ";" and the replacements waiting
// to join.
std::string FaultTolerantManager::decide(bool all_ok, bool admit) {
  std::vector<std::string> votes;
  for (int member : members_) votes.push_back(step_key("vote/" + std::to_string(member)));
  std::string verdict;
  if (all_ok) {
    verdict = "commit";
  } else if (await_votes(votes)) {
    const auto values = store_->multi_get(votes);
    const bool every_vote_ok = std::all_of(values.begin(), values.end(), [](const auto& v) {
      return v.size() == 1 && v[0] == '1';
    });
    verdict = every_vote_ok ? "commit" : wire_list(members_);
  } else {
    std::vector<int> voted;
    for (size_t i = 0; i < votes.size(); ++i) {
      if (store_->check({votes[i]})) voted.push_back(members_[i]);
    }
    verdict = wire_list(voted);
  }
  return with_joiners(verdict, admit);
}

// `verdict`, with `admit` followed by ";" and the replacements waiting to join, if any; a store
// request when none waits.
std::string FaultTolerantManager::with_joiners(const std::string& verdict, bool admit) {
  if (!admit) return verdict;
  joins_counted_ = store_->add(kWaitingJoinsKey, 0);
  if (joins_counted_ <= 0) return verdict;
  const std::string joiners = joiners_text();
  return joiners.empty() ? verdict : verdict + ";" + joiners;
}

// The replacements that asked to join and were not admitted yet, as "rank:incarnation,...".
std::string FaultTolerantManager::joiners_text() const {
  std::ostringstream text;
  for (int r = 0; r < world_size_; ++r) {
    if (contains(members_, r) || contains(pending_joiners_, r) || !store_->check({join_key(r)})) {
      continue;
    }
    const int64_t incarnation = parse_count(store_->get_string(join_key(r)), join_key(r));
    // Admitted already, or the asker exited since it asked (it timed out, or was killed).
    if (store_->check({admitted_key(r, incarnation)}) ||
        store_->add(exit_key(r), 0) > incarnation) {
      continue;
    }
    text << (text.tellp() > 0 ? "," : "") << r << ":" << incarnation;
  }
  return text.str();
}

}  // namespace shoal::parallel
