// ProcessGroupGloo: Shoal's process group over c10d's Gloo (TCP), for any number of hosts.
//
// Adds what c10d's Gloo lacks: avg reduction, bfloat16 (reduced in float32), reduce_scatter, and
// errors that name the rank, the operation with its sequence number, and the peer at fault.
//
// After any failed operation (a time-out, a dead peer, a peer whose heartbeat stood still) the
// group is broken: its destructor leaks c10d's group instead of destroying it, because c10d's
// destructor joins worker threads that may be stuck in a receive from a stopped peer until c10d's
// time-out (minutes). The error then reaches the user, and the process exits, within seconds.
//
// Thread safety: as ProcessGroup.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "comm/algorithms/allreduce_algorithm.h"
#include "shoal/comm/process_group.h"
#include "shoal/comm/store.h"

namespace shoal::compat {
class GlooGroup;
class NativeWork;
}

namespace shoal::comm {

class PeerDirectory;

struct GlooOptions {
  /// Address the other ranks reach this one at; "127.0.0.1" when every rank is on one host.
  std::string hostname = "127.0.0.1";
  /// Network interface to use instead of `hostname` (GLOO_SOCKET_IFNAME), when not empty.
  std::string interface;
  /// reduce_scatter as a ring of point-to-point sends (each rank sends and receives N-1 blocks,
  /// holding two); false: an allreduce of every block (N times the bytes, a copy of the input),
  /// kept as the simplest correct form to measure the ring against
  /// (SHOAL_GLOO_REDUCE_SCATTER=allreduce sets it false).
  bool ring_reduce_scatter = true;
  /// How allreduce runs: c10d Gloo's own (kNative), one of Shoal's schedules over point-to-point
  /// messages, or kAuto: the schedule the cost model predicts fastest for each call's size.
  /// Unset: SHOAL_ALLREDUCE_ALGO, else its default.
  std::optional<algorithms::AllreduceAlgorithm> allreduce_algorithm;
  /// Ranks per node, node by node in rank order, for the cost model; 0: every rank on this host
  /// when `hostname` is the loopback address and no interface is named, else one per node.
  int ranks_per_node = 0;
};

class ProcessGroupGloo : public ProcessGroup {
 public:
  ProcessGroupGloo(std::shared_ptr<Store> store, int rank, int size, Milliseconds timeout,
                   GlooOptions options = {});
  ~ProcessGroupGloo() override;

  std::string backend_name() const override { return "gloo"; }

  /// Marks the group broken: its destructor then abandons c10d's group (see below).
  void abort(const std::string& reason) override;

  /// Replaces the allreduce algorithm chosen at construction; from the thread that issues the
  /// operations, between them (a bench races several on one group).
  void set_allreduce_algorithm(algorithms::AllreduceAlgorithm algorithm) {
    allreduce_algorithm_ = algorithm;
  }
  /// The schedule an allreduce of `bytes` runs (kNative included; never kAuto).
  algorithms::AllreduceAlgorithm allreduce_algorithm_for(int64_t bytes) const;
  /// What the cost model knows of where this group's ranks are.
  const algorithms::Topology& allreduce_topology() const { return topology_; }
  /// The schedule the last allreduce ran (kNative before any).
  algorithms::AllreduceAlgorithm last_allreduce_algorithm() const { return last_allreduce_; }

 protected:
  std::shared_ptr<Work> run_allreduce(at::Tensor& tensor, ReduceOp op,
                                      const OpContext& ctx) override;
  /// An allreduce by one of Shoal's schedules, on the caller's thread (the Work it returns is
  /// complete); every message waits at most the op's time-out and a failure names the peer.
  std::shared_ptr<Work> scheduled_allreduce(algorithms::AllreduceAlgorithm algorithm,
                                            at::Tensor& tensor, ReduceOp op, const OpContext& ctx);
  std::shared_ptr<Work> run_broadcast(at::Tensor& tensor, int root, const OpContext& ctx) override;
  std::shared_ptr<Work> run_reduce(at::Tensor& tensor, int root, ReduceOp op,
                                   const OpContext& ctx) override;
  std::shared_ptr<Work> run_allgather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                      const OpContext& ctx) override;
  std::shared_ptr<Work> ring_reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs,
                                            ReduceOp op, const OpContext& ctx);
  std::shared_ptr<Work> run_reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs,
                                           ReduceOp op, const OpContext& ctx) override;
  std::shared_ptr<Work> run_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                   int root, const OpContext& ctx) override;
  std::shared_ptr<Work> run_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs, int root,
                                    const OpContext& ctx) override;
  std::shared_ptr<Work> run_send(const at::Tensor& tensor, int dst, int tag,
                                 const OpContext& ctx) override;
  std::shared_ptr<Work> run_recv(at::Tensor& tensor, int src, int tag,
                                 const OpContext& ctx) override;
  std::shared_ptr<Work> run_barrier(const OpContext& ctx) override;
  std::shared_ptr<ProcessGroup> run_new_group(const std::vector<int>& ranks, int group_rank,
                                              uint64_t group_id) override;

 private:
  /// The Work of a collective: its wait watches the other ranks' heartbeats (a peer stopped on
  /// another host is named in seconds, not at the time-out). Send and recv are not watched.
  std::shared_ptr<Work> collective_work(const OpContext& ctx,
                                        std::unique_ptr<compat::NativeWork> native,
                                        std::function<void()> on_success);
  /// A send's or recv's Work (not watched; c10d ends them at the time-out).
  std::shared_ptr<Work> point_to_point_work(const OpContext& ctx,
                                            std::unique_ptr<compat::NativeWork> native);

  std::shared_ptr<Store> store_;
  GlooOptions options_;
  std::unique_ptr<compat::GlooGroup> gloo_;
  std::shared_ptr<PeerDirectory> peers_;
  // Set by a failed operation's Work (which may outlive the group) or abort().
  std::shared_ptr<std::atomic<bool>> broken_ = std::make_shared<std::atomic<bool>>(false);
  algorithms::AllreduceAlgorithm allreduce_algorithm_ = algorithms::AllreduceAlgorithm::kNative;
  algorithms::Topology topology_;
  algorithms::CostModel cost_model_ = algorithms::CostModel::defaults();
  algorithms::AllreduceAlgorithm last_allreduce_ = algorithms::AllreduceAlgorithm::kNative;
  std::vector<int> global_ranks_;  // rank in the world of each rank of this group, for messages
};

}  // namespace shoal::comm
