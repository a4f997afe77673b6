#include "launcher/elastic_rendezvous.h"

#include <algorithm>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>

#include "comm/hang_reporter.h"
#include "comm/timeouts.h"
#include "shoal/comm/store.h"
#include "shoal/error.h"
#include "shoal/log.h"
#include "shoal/parallel/fault_tolerant_manager.h"

namespace shoal::launcher {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kStartedKey = "rdzv/started";
constexpr const char* kAgentsKey = "rdzv/agents";  // the agents running
// Why 50 ms: node 0 polls the registrations while the round is open; a node arriving is seen
// within a slice, at one request per node and slice.
constexpr std::chrono::milliseconds kRoundPollSlice{50};

std::string round_node_key(int node) { return "rdzv/node/" + std::to_string(node); }

std::string node_list_text(const std::vector<int>& items) {
  std::ostringstream text;
  for (size_t i = 0; i < items.size(); ++i) text << (i ? "," : "") << items[i];
  return text.str();
}

std::vector<int> parse_node_list(const std::string& text) {
  std::vector<int> items;
  std::istringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    SHOAL_CHECK_T(PeerError,
                  !item.empty() && item.size() < 7 &&
                      item.find_first_not_of("0123456789") == std::string::npos,
                  "shoal run: the store's '", kStartedKey, "' holds '", text.substr(0, 40),
                  "', not a list of nodes: is another job using this rendezvous endpoint?");
    items.push_back(std::stoi(item));
  }
  return items;
}

std::string round_nnodes_text(const ElasticRound& round) {
  return std::to_string(round.min_nodes) + ":" + std::to_string(round.max_nodes);
}

std::vector<int> registered_nodes(comm::Store& store, int max_nodes) {
  std::vector<int> nodes;
  for (int node = 0; node < max_nodes; ++node) {
    if (store.check({round_node_key(node)})) nodes.push_back(node);
  }
  return nodes;
}

// Node 0: the nodes that start the job, once all MAX registered or MIN did and the last call has
// passed.
std::vector<int> close_round(comm::Store& store, const ElasticRound& round) {
  const auto give_up = Clock::now() + round.join_timeout;
  std::optional<Clock::time_point> last_call_ends;
  while (true) {
    const std::vector<int> nodes = registered_nodes(store, round.max_nodes);
    const int count = static_cast<int>(nodes.size());
    if (count == round.max_nodes) return nodes;
    if (count >= round.min_nodes) {
      if (!last_call_ends) last_call_ends = Clock::now() + round.last_call;
      if (Clock::now() >= *last_call_ends) return nodes;
    }
    SHOAL_CHECK_T(TimeoutError, count >= round.min_nodes || Clock::now() < give_up,
                  "shoal run: --nnodes ", round_nnodes_text(round), ": only ", count, " node",
                  count == 1 ? "" : "s", " (", node_list_text(nodes), ") met within ",
                  round.join_timeout.count() / 1000, " s (--rdzv-conf join_timeout): start the ",
                  "others' shoal run with this --rdzv-endpoint and their own --node-rank");
    std::this_thread::sleep_for(kRoundPollSlice);
  }
}

void publish_round(comm::Store& store, const ElasticRound& round, const std::vector<int>& nodes) {
  std::vector<int> ranks;
  for (int node : nodes) {
    for (int local = 0; local < round.local_size; ++local)
      ranks.push_back(node * round.local_size + local);
  }
  store.set_string(parallel::FaultTolerantManager::founders_key(), node_list_text(ranks));
  store.set_string(kStartedKey, node_list_text(nodes));
}

// Whether a heartbeat of this node's ranks moves within the heartbeat time-out: a node rank seen
// before is a node coming back only once its earlier ranks have fallen silent.
bool node_ranks_beating(comm::Store& store, const ElasticRound& round) {
  const auto silent_until = Clock::now() + comm::silent_peer_timeout();
  std::map<int, int64_t> first;
  while (true) {
    for (int local = 0; local < round.local_size; ++local) {
      const int rank = round.node_rank * round.local_size + local;
      const int64_t beat = store.add(parallel::FaultTolerantManager::heartbeat_key(rank), 0);
      if (first.emplace(rank, beat).first->second != beat) return true;
    }
    if (Clock::now() >= silent_until) return false;
    std::this_thread::sleep_for(comm::beat_interval());
  }
}

// A node rank started twice must not pass for one coming back: the other nodes would count its
// live workers out and a second process would claim their ranks. Checked before this agent
// touches the store, so that a refused one changes nothing.
void refuse_running_node(comm::Store& store, const ElasticRound& round) {
  if (!store.check({round_node_key(round.node_rank)})) return;
  SHOAL_CHECK_T(InvalidArgument, !node_ranks_beating(store, round), "shoal run: node rank ",
                round.node_rank, " is already running in this job (its workers' heartbeats ",
                "move): stop it first, or give this shoal run another --node-rank");
}

}  // namespace

ElasticMembership meet_elastic(comm::Store& store, const ElasticRound& round) {
  refuse_running_node(store, round);
  store.add(kAgentsKey, 1);
  const int64_t arrivals = store.add(round_node_key(round.node_rank), 1);
  if (round.node_rank == 0) publish_round(store, round, close_round(store, round));
  try {
    store.wait({kStartedKey}, round.join_timeout);
  } catch (const TimeoutError&) {
    SHOAL_THROW(TimeoutError, "shoal run: --nnodes ", round_nnodes_text(round),
                ": node 0 did not start ", "the job within ", round.join_timeout.count() / 1000,
                " s (--rdzv-conf join_timeout): is node 0's shoal run running?");
  }
  ElasticMembership membership;
  membership.started_with = parse_node_list(store.get_string(kStartedKey));
  const auto& nodes = membership.started_with;
  membership.founder =
      arrivals == 1 && std::find(nodes.begin(), nodes.end(), round.node_rank) != nodes.end();
  if (!membership.founder) {
    // Its ranks' predecessors (never started, or gone with a node that left) count as exited,
    // so that its workers join the running replicas.
    for (int local = 0; local < round.local_size; ++local) {
      store.add(
          parallel::FaultTolerantManager::exit_key(round.node_rank * round.local_size + local), 1);
    }
  }
  log::info("shoal run: the job started with node", nodes.size() == 1 ? " " : "s ",
            node_list_text(nodes), " (--nnodes ", round_nnodes_text(round), "); node ",
            round.node_rank, membership.founder ? " is one of them" : " joins the running job");
  return membership;
}

void leave_elastic(comm::Store& store) { store.add(kAgentsKey, -1); }

void outlive_other_nodes(comm::Store& store, int world_size) {
  const auto limit = comm::silent_peer_timeout();
  std::map<int, int64_t> beats;
  auto moved_at = Clock::now();
  while (store.add(kAgentsKey, 0) > 1) {
    bool moved = false;
    for (int rank = 0; rank < world_size; ++rank) {
      const int64_t now = store.add(parallel::FaultTolerantManager::heartbeat_key(rank), 0);
      moved |= beats[rank] != now;
      beats[rank] = now;
    }
    if (moved) moved_at = Clock::now();
    if (Clock::now() - moved_at >= limit) return;
    std::this_thread::sleep_for(comm::beat_interval());
  }
}

}  // namespace shoal::launcher
