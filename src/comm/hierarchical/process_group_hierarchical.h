// ProcessGroupHierarchical: shm between the ranks of each host, Gloo between one leader per host.
//
// Ranks are grouped by host name (exchanged through the store; SHOAL_HOSTNAME overrides the name
// used for grouping, so that one machine can pretend to be several in tests). Hosts are numbered
// in the order of their lowest rank; a host's leader is its lowest rank; a rank's local rank is
// its position among its host's ranks. Ranks of one host need not be consecutive.
//
// Only the leaders talk over the network, each carrying its whole host's share:
//   allreduce       shm reduce onto the leader, Gloo allreduce between leaders, shm broadcast
//   broadcast       shm broadcast from the root on its host, Gloo broadcast from the root's
//                   leader, shm broadcast from the leader on every other host
//   reduce          shm reduce onto the leader, Gloo reduce onto the root's leader, which passes
//                   the result to the root over shm when the root is not the leader
//   allgather       shm gather onto the leader, Gloo allgather of the host parts between leaders
//                   (one Gloo broadcast per host between uneven hosts), shm broadcast
//   gather          shm gather onto the leader, Gloo gather of the host parts onto the root's
//                   leader, which passes them to the root over shm when the root is not the leader
//   scatter         the reverse of gather: root to its leader, Gloo scatter of the host parts,
//                   shm scatter inside every host
//   reduce_scatter  shm reduce of every block onto the leader, Gloo allreduce between leaders
//                   (Gloo has no reduce_scatter), shm scatter of this host's blocks
//   barrier         shm barrier, Gloo barrier between leaders, shm barrier
// The reductions, broadcast and allgather send fewer bytes between hosts than a flat Gloo group
// (tests/comm/hier_traffic measures it); gather and scatter as many when the hosts are even (every
// rank's part is distinct), but in one message per host instead of one per rank; between uneven
// hosts Gloo's equal parts make them carry the smaller hosts' padding too.
// The leaders use only collectives on their Gloo group (no point-to-point), so that its operation
// numbers stay equal on every leader and a failure report can name the leader that is missing.
// avg sums up the tree and divides once at the end, so integer averages truncate once, exactly.
// With a single host every collective is the shm group's own. Point-to-point operations use a
// flat Gloo group of every rank.
//
// Each stage of a collective waits at most the collective's time-out; when a stage fails, the
// group is aborted so that the other ranks of the host fail at once instead of waiting for a
// leader that will not come.
//
// Thread safety: as ProcessGroup.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shoal/comm/process_group.h"
#include "shoal/comm/store.h"

namespace shoal::comm {

namespace shm {
class OpQueue;
}

class ProcessGroupHierarchical : public ProcessGroup {
 public:
  ProcessGroupHierarchical(std::shared_ptr<Store> store, int rank, int size, Milliseconds timeout);
  ~ProcessGroupHierarchical() override;

  std::string backend_name() const override { return "hierarchical"; }
  void abort(const std::string& reason) override;
  /// On one host, symmetric tensors are the shm group's (its allreduce works in place on them).
  bool is_symmetric(const at::Tensor& tensor) const override;

  /// Number of hosts the ranks were grouped into (for tests and logs).
  int num_hosts() const { return num_hosts_; }

 protected:
  at::Tensor run_empty_symmetric(int64_t numel, at::ScalarType dtype,
                                 const OpContext& ctx) override;
  std::shared_ptr<Work> run_allreduce(at::Tensor& tensor, ReduceOp op,
                                      const OpContext& ctx) override;
  std::shared_ptr<Work> run_broadcast(at::Tensor& tensor, int root, const OpContext& ctx) override;
  std::shared_ptr<Work> run_reduce(at::Tensor& tensor, int root, ReduceOp op,
                                   const OpContext& ctx) override;
  std::shared_ptr<Work> run_allgather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                      const OpContext& ctx) override;
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
  // Runs `body` on the worker thread, in issue order, and prefixes its errors with the context.
  std::shared_ptr<Work> submit(const OpContext& ctx, std::function<void()> body);

  bool is_leader() const { return leaders_ != nullptr; }
  // Offset in elements of rank r's `numel` elements in a buffer of every host's part, host after
  // host, each in local rank order (host h's local rank i at host_first_[h] + i).
  int64_t packed_offset(int r, int64_t numel) const;
  // The same with every host's part padded to the largest host's (host h's local rank i at
  // h * max_local_size_ + i), as Gloo's gather and scatter need. Equal when the hosts are even.
  int64_t padded_offset(int r, int64_t numel) const;
  // Copies rank r's part of `blocks` (packed, or `padded` as in padded_offset) into outputs[r],
  // for every rank.
  void unpack(const at::Tensor& blocks, std::vector<at::Tensor>& outputs,
              bool padded = false) const;
  // Byte views of every host's padded part of `blocks` (`host_block` elements each).
  static std::vector<at::Tensor> padded_parts(const at::Tensor& blocks, int64_t host_block,
                                              int num_hosts);
  // Every rank of this host calls it: the leader receives the host's inputs into `views` (one per
  // local rank, in local rank order); the others pass none.
  void gather_on_leader(const at::Tensor& input, std::vector<at::Tensor> views,
                        Milliseconds timeout);
  // The reverse: each rank of this host gets its view of the leader's `views` in `output`.
  void scatter_from_leader(at::Tensor& output, std::vector<at::Tensor> views,
                           Milliseconds timeout);
  // One view per local rank into `local_block` (this host's ranks' parts, in local rank order),
  // each shaped like `like`.
  std::vector<at::Tensor> local_views(const at::Tensor& local_block, const at::Tensor& like) const;

  // The collectives' stages, run on the worker thread.
  void allreduce_tree(at::Tensor& tensor, ReduceOp op, Milliseconds timeout);
  void broadcast_tree(at::Tensor& tensor, int root, Milliseconds timeout);
  void reduce_tree(at::Tensor& tensor, int root, ReduceOp op, Milliseconds timeout);
  void allgather_tree(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                      Milliseconds timeout);
  void gather_tree(std::vector<at::Tensor>& outputs, const at::Tensor& input, int root,
                   Milliseconds timeout);
  void scatter_tree(at::Tensor& output, std::vector<at::Tensor>& inputs, int root,
                    Milliseconds timeout);
  void reduce_scatter_tree(at::Tensor& output, std::vector<at::Tensor>& inputs, ReduceOp op,
                           Milliseconds timeout);
  void barrier_tree(Milliseconds timeout);

  std::shared_ptr<Store> store_;
  int num_hosts_ = 1;
  int my_host_ = 0;
  int local_rank_ = 0;
  int local_size_ = 1;
  bool even_hosts_ = true;  // every host has as many ranks
  int max_local_size_ = 1;
  std::vector<int> host_of_;                  // per rank: its host's number
  std::vector<int> local_rank_of_;            // per rank: its rank in its host's local group
  std::vector<std::vector<int>> host_ranks_;  // per host: its ranks, by local rank
  std::vector<int> host_first_;               // per host: ranks of the hosts before it
  std::string layout_;  // "local group = ranks 2,3 on host-b; leaders = ranks 0,2", for errors
  std::shared_ptr<ProcessGroup> local_;    // shm, the ranks of this host
  std::shared_ptr<ProcessGroup> leaders_;  // gloo, one rank per host; null on non-leaders
  std::shared_ptr<ProcessGroup> flat_;     // gloo, every rank (point-to-point)
  std::shared_ptr<shm::OpQueue> queue_;  // shared with the Works that may run its tasks
};

}  // namespace shoal::comm
