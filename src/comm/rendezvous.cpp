#include "comm/rendezvous.h"

#include <algorithm>
#include <chrono>
#include <sstream>

#include "comm/timeouts.h"
#include "shoal/error.h"

namespace shoal::comm {
namespace {

using Clock = std::chrono::steady_clock;

const std::string kPrefix = "shoal/init/";
// How long a rank that timed out waits for the first one's list of absent ranks, and how long
// that one spends looking (a key per rank until it has found kListed).
constexpr Milliseconds kListBudget{2'000};
// Absent ranks named by number; the rest are counted.
constexpr int kListed = 8;

struct Meeting {
  Store& store;
  int rank;
  int world_size;
  Milliseconds timeout;
  Clock::time_point deadline;
  std::string who;
};

Milliseconds left(const Meeting& m) {
  const auto ms = std::chrono::duration_cast<Milliseconds>(m.deadline - Clock::now());
  return std::max(ms, Milliseconds(1));
}

/// The first of all ranks to call this decides the verdict: "ok" or an error every rank reports.
void publish_verdict(const Meeting& m, const std::string& verdict) {
  if (m.store.add(kPrefix + "decided", 1) == 1) m.store.set_string(kPrefix + "verdict", verdict);
}

/// Waits for `key` until the meeting's deadline: false when it did not appear.
bool wait_for(const Meeting& m, const std::string& key) {
  try {
    m.store.wait({key}, left(m));
    return true;
  } catch (const TimeoutError&) {
    return false;
  }
}

/// "1, 2, ... (7 of 8)": the absent ranks (those without a claim), found by the first rank to
/// time out and published for the others.
std::string absent_ranks(const Meeting& m, int64_t absent) {
  const std::string key = kPrefix + "absent";
  if (m.store.add(kPrefix + "absent_lister", 1) != 1) {
    try {
      m.store.wait({key}, kListBudget);
      return m.store.get_string(key);
    } catch (const TimeoutError&) {
      return std::to_string(absent) + " of " + std::to_string(m.world_size);
    }
  }
  const auto stop = Clock::now() + kListBudget;
  std::ostringstream list;
  int listed = 0;
  for (int r = 0; r < m.world_size && listed < kListed && Clock::now() < stop; ++r) {
    if (m.store.check({kPrefix + "claim/" + std::to_string(r)})) continue;
    list << (listed++ ? ", " : "") << r;
  }
  if (absent > listed) list << ", ... (" << absent << " of " << m.world_size << ")";
  m.store.set_string(key, list.str());
  return list.str();
}

[[noreturn]] void throw_absent(const Meeting& m) {
  const int64_t arrived = m.store.add(kPrefix + "arrived", 0);
  const int64_t absent = std::max<int64_t>(m.world_size - arrived, 1);
  SHOAL_THROW(TimeoutError, m.who, " rendezvous: rank", absent > 1 ? "s " : " ", absent_ranks(m, absent),
              " did not join within ", m.timeout.count(),
              " ms (are they started, with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE?)", kTimeoutHint);
}

void claim_rank(const Meeting& m) {
  if (m.store.add(kPrefix + "claim/" + std::to_string(m.rank), 1) == 1) return;
  const std::string error = detail::str_cat(
      "two processes claim rank ", m.rank,
      "; give every process its own RANK (a stale file store from an earlier job causes this too: delete it)");
  publish_verdict(m, error);
  SHOAL_THROW(InvalidArgument, m.who, " ", error);
}

/// The first rank to arrive publishes "world_size rank"; every other compares its own with it.
void compare_world_size(const Meeting& m) {
  const std::string key = kPrefix + "world_size";
  if (m.store.add(kPrefix + "first", 1) == 1) {
    m.store.set_string(key, std::to_string(m.world_size) + " " + std::to_string(m.rank));
    return;
  }
  if (!wait_for(m, key)) throw_absent(m);
  std::istringstream in(m.store.get_string(key));
  int size = 0;
  int first = 0;
  in >> size >> first;
  if (size == m.world_size) return;
  const std::string error = detail::str_cat(
      "rank ", m.rank, " was started with world size ", m.world_size, " but rank ", first, " with ", size,
      "; start every rank with the same WORLD_SIZE");
  publish_verdict(m, error);
  SHOAL_THROW(InvalidArgument, m.who, " ", error);
}

}  // namespace

void rendezvous(Store& store, int rank, int world_size, Milliseconds timeout) {
  const Meeting m{store, rank, world_size, timeout, Clock::now() + timeout,
                  detail::str_cat("[rank ", rank, "/", world_size, "]")};
  claim_rank(m);
  compare_world_size(m);
  if (store.add(kPrefix + "arrived", 1) == world_size) publish_verdict(m, "ok");
  const std::string key = kPrefix + "verdict";
  if (!wait_for(m, key)) throw_absent(m);
  const std::string verdict = store.get_string(key);
  SHOAL_CHECK_T(InvalidArgument, verdict == "ok", m.who, " ", verdict);
}

}  // namespace shoal::comm
