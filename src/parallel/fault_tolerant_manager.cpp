#include "shoal/parallel/fault_tolerant_manager.h"

#include <algorithm>
#include <chrono>
#include <sstream>

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

std::vector<int> parse_member_list(const std::string& text) {
  std::vector<int> ranks;
  std::istringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) ranks.push_back(std::stoi(item));
  }
  return ranks;
}

// The step's tally (step_key("tally")), one counter that every replica adds to once: 1 for an ok
// vote, kFailedVote for a failed one; a replica that stops waiting adds kClosed too.
constexpr int64_t kFailedVote = int64_t{1} << 20;  // above any count of replicas
constexpr int64_t kClosed = int64_t{1} << 40;
constexpr int64_t kFieldMask = kFailedVote - 1;

int64_t ok_votes(int64_t tally) { return tally & kFieldMask; }
int64_t failed_votes(int64_t tally) { return (tally / kFailedVote) & kFieldMask; }
bool failed_or_closed(int64_t tally) { return tally >= kFailedVote; }

}  // namespace

FaultTolerantManager::FaultTolerantManager(std::shared_ptr<comm::Store> store, int rank,
                                           int world_size, FaultTolerantOptions options)
    : store_(std::move(store)), rank_(rank), options_(std::move(options)) {
  SHOAL_CHECK_T(InvalidArgument, store_ != nullptr, "FaultTolerantManager: no store given");
  SHOAL_CHECK_T(InvalidArgument, rank >= 0 && rank < world_size, "FaultTolerantManager: rank ",
                rank, " is not in 0..", world_size - 1);
  SHOAL_CHECK_T(InvalidArgument, options_.min_replicas >= 1 && options_.min_replicas <= world_size,
                "--min-replicas ", options_.min_replicas, " must be in 1..", world_size,
                " (the job's replicas)");
  for (int r = 0; r < world_size; ++r) members_.push_back(r);
  form_group();
}

FaultTolerantManager::~FaultTolerantManager() = default;

int FaultTolerantManager::replica_rank() const {
  return static_cast<int>(std::find(members_.begin(), members_.end(), rank_) - members_.begin());
}

std::string FaultTolerantManager::step_key(const std::string& what) const {
  return "ft/g" + std::to_string(generation_) + "/s" + std::to_string(attempt_) + "/" + what;
}

void FaultTolerantManager::form_group() {
  auto prefix = comm::make_prefix_store("ft/g" + std::to_string(generation_) + "/pg", store_);
  group_ = comm::new_process_group(options_.backend, prefix, replica_rank(), num_replicas(),
                                   options_.timeout);
}

void FaultTolerantManager::start_quorum() {
  if (next_members_.empty()) return;
  const bool kept = std::find(next_members_.begin(), next_members_.end(), rank_) !=
                    next_members_.end();
  SHOAL_CHECK_T(PeerError, kept, "[rank ", rank_, "] left out of the job's replicas after step ",
                attempt_, " of generation ", generation_,
                " failed: its vote did not come in time (was it stopped?); the job goes on without it");
  SHOAL_CHECK_T(InvalidArgument, static_cast<int>(next_members_.size()) >= options_.min_replicas,
                "[rank ", rank_, "] ", next_members_.size(), " replica",
                next_members_.size() == 1 ? "" : "s", " left (ranks ", member_list_text(next_members_),
                "), fewer than --min-replicas ", options_.min_replicas,
                ": the job cannot go on; lower --min-replicas or restart it");
  group_.reset();
  members_ = std::move(next_members_);
  next_members_.clear();
  ++generation_;
  attempt_ = 0;
  log::warn("[rank ", rank_, "] fault tolerance: generation ", generation_, " goes on with ",
            members_.size(), " replicas (ranks ", member_list_text(members_), ")");
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

bool FaultTolerantManager::should_commit() {
  const bool ok = step_ok_;
  step_ok_ = true;
  const bool committed = ok ? tally_ok_vote() : false;
  const bool decided = committed || decide_slowly(ok);
  ++attempt_;
  if (decided) return true;
  ++failed_steps_;
  return false;
}

// The common case, two store requests: the vote that completes the tally (exactly the members'
// count, nothing failed or closed before it) commits the step for all and says so under "all";
// the others wait for that. False when the step must be settled by decide_slowly().
bool FaultTolerantManager::tally_ok_vote() {
  const int64_t tally = store_->add(step_key("tally"), 1);
  if (tally == num_replicas()) {
    store_->set_string(step_key("all"), "1");
    return true;
  }
  return !failed_or_closed(tally) && await_all();
}

// Waits for "all"; false once a member's exit is reported, a vote failed or the tally closed, or
// the wait is past timeout + quorum_grace.
bool FaultTolerantManager::await_all() const {
  // The store answers a wait the moment its key arrives; the slice bounds how late a failure
  // elsewhere is noticed.
  constexpr comm::Milliseconds kSlice{50};
  const auto give_up = std::chrono::steady_clock::now() + options_.timeout + options_.quorum_grace;
  std::vector<std::string> exits;
  for (int member : members_) exits.push_back(exit_key(member));
  while (true) {
    try {
      store_->wait({step_key("all")}, kSlice);
      return true;
    } catch (const TimeoutError&) {
    }
    if (failed_or_closed(store_->add(step_key("tally"), 0)) || any_exited(exits) ||
        std::chrono::steady_clock::now() >= give_up) {
      return false;
    }
  }
}

// After a failure, a missing vote or a late one: closes the tally (a vote after this cannot
// complete it), weighs the votes, and the first replica done publishes its verdict, which every
// replica in here reads. No replica committed on the tally unless every member voted ok before
// the first close, and then every verdict here is "commit" too.
bool FaultTolerantManager::decide_slowly(bool ok) {
  if (!ok) store_->add(step_key("tally"), kFailedVote);
  store_->set_string(step_key("vote/" + std::to_string(rank_)), ok ? "1" : "0");
  const int64_t tally = store_->add(step_key("tally"), kClosed) - kClosed;
  const bool all_ok = ok_votes(tally) == num_replicas() && failed_votes(tally) == 0;
  // The ticket comes after the weighing, so a replica killed while it waits for the votes (the
  // long part) holds up no one.
  const std::string verdict = all_ok ? "commit" : decide();
  const std::string decision_key = step_key("decision");
  if (store_->add(step_key("ticket"), 1) == 1) store_->set_string(decision_key, verdict);
  store_->wait({decision_key}, options_.timeout + options_.quorum_grace);
  const std::string decision = store_->get_string(decision_key);
  if (decision == "commit") return true;
  next_members_ = parse_member_list(decision);
  return false;
}

std::string FaultTolerantManager::exit_key(int rank) { return "ft/exited/" + std::to_string(rank); }

// Whether every member voted or exited.
bool FaultTolerantManager::settled(const std::vector<std::string>& votes,
                                   const std::vector<std::string>& exits) const {
  for (size_t i = 0; i < votes.size(); ++i) {
    if (!store_->check({votes[i]}) && !store_->check({exits[i]})) return false;
  }
  return true;
}

bool FaultTolerantManager::any_exited(const std::vector<std::string>& exits) const {
  return std::any_of(exits.begin(), exits.end(),
                     [&](const std::string& key) { return store_->check({key}); });
}

// Waits until every member voted or exited, or until timeout + quorum_grace; true when all voted.
bool FaultTolerantManager::await_votes(const std::vector<std::string>& votes,
                                       const std::vector<std::string>& exits) const {
  // The store answers a wait the moment its last key arrives; the slice only bounds how late an
  // exit the launcher reported is noticed.
  constexpr comm::Milliseconds kSlice{200};
  const auto give_up = std::chrono::steady_clock::now() + options_.timeout + options_.quorum_grace;
  while (true) {
    try {
      store_->wait(votes, kSlice);
      return true;
    } catch (const TimeoutError&) {
    }
    if (settled(votes, exits) || std::chrono::steady_clock::now() >= give_up) return false;
  }
}

// This member's verdict on the current step: "commit", or the members that voted.
std::string FaultTolerantManager::decide() const {
  std::vector<std::string> votes, exits;
  for (int member : members_) {
    votes.push_back(step_key("vote/" + std::to_string(member)));
    exits.push_back(exit_key(member));
  }
  if (await_votes(votes, exits)) {
    const auto values = store_->multi_get(votes);
    const bool all_ok = std::all_of(values.begin(), values.end(), [](const auto& v) {
      return v.size() == 1 && v[0] == '1';
    });
    return all_ok ? "commit" : member_list_text(members_);
  }
  std::vector<int> voted;
  for (size_t i = 0; i < votes.size(); ++i) {
    if (store_->check({votes[i]})) voted.push_back(members_[i]);
  }
  return member_list_text(voted);
}

}  // namespace shoal::parallel
