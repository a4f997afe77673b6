// Elastic membership (`shoal run --nnodes MIN:MAX` with fault tolerance): where the node agents
// meet, and which of them start the job.
//
// Node 0's agent serves the job's store (launch.cpp) and hosts the rendezvous: every agent, node
// 0's included, registers its --node-rank there ("rdzv/node/<k>", a counter). Node 0 closes the
// round once all MAX nodes registered, or once MIN did and the last call (--rdzv-conf
// last_call_timeout) has passed, as torchrun's c10d rendezvous does; it then publishes the job
// ranks that start the job (FaultTolerantManager::founders_key()) and the founding nodes
// ("rdzv/started"). Node ranks stay static (each agent's --node-rank), so a node's job ranks are
// node_rank * nproc_per_node + local rank, and WORLD_SIZE is MAX nodes' ranks.
//
// An agent that registers after the round closed (a late node), or whose node rank registered
// before (a node that left and came back), starts its workers as replacements: it adds 1 to each
// of its ranks' exit count (FaultTolerantManager::exit_key), so that they ask to join the running
// replicas at a step boundary and receive the state from a live peer. A node rank that registered
// before counts as coming back only when its earlier ranks' heartbeats stand still for
// SHOAL_HEARTBEAT_TIMEOUT; where they move, the node runs already and the agent is refused. The per-step quorum is the
// replicas' own (in the store); the coordinator of membership is the store, so node 0's agent
// must live as long as the job: when it dies the store goes with it and the job fails.
//
// Node 0's agent keeps the store up after its own workers end, until the other nodes' agents
// have ended too (each counts itself out, "rdzv/agents"), or, where one was killed, until no rank's
// heartbeat has moved for SHOAL_HEARTBEAT_TIMEOUT: the replicas finish together, and the last
// decision one of them reads must still be there.
//
// Thread safety: every function is called from the launcher's thread, meet_elastic() once, then
// one of leave_elastic() or outlive_other_nodes() once.
#pragma once

#include <chrono>
#include <vector>

namespace shoal::comm {
class Store;
}

namespace shoal::launcher {

struct ElasticMembership {
  /// Whether this node is one the job starts with; false: its workers join as replacements.
  bool founder = true;
  /// The nodes the job started with, ascending.
  std::vector<int> started_with;
};

struct ElasticRound {
  int min_nodes = 1;
  int max_nodes = 1;
  int node_rank = 0;
  /// This node's processes (its job ranks are node_rank * local_size + 0..local_size-1).
  int local_size = 1;
  /// How long node 0 waits for MIN nodes, and any node for the round to close.
  std::chrono::milliseconds join_timeout{600'000};
  /// How long node 0 waits for more nodes once MIN are there.
  std::chrono::milliseconds last_call{30'000};
};

/// Registers this node in `store` (node 0's) and returns its part in the job; node 0 closes the
/// round first. Throws TimeoutError naming --nnodes when the round does not close in time, and
/// InvalidArgument when this node rank runs already.
ElasticMembership meet_elastic(comm::Store& store, const ElasticRound& round);

/// A node other than 0, once its workers ended: counts its agent out.
void leave_elastic(comm::Store& store);

/// Node 0, once its workers ended: returns when every other agent counted itself out, or no rank
/// of the job's `world_size` has beaten for SHOAL_HEARTBEAT_TIMEOUT.
void outlive_other_nodes(comm::Store& store, int world_size);

}  // namespace shoal::launcher
