// ProcessGroupHierarchical: shm between the ranks of each host, Gloo between one leader per host.
//
// Ranks are grouped by host name (exchanged through the store; SHOAL_HOSTNAME overrides the name
// used for grouping, so that one machine can pretend to be several in tests). allreduce reduces
// inside each host over shared memory onto the host's leader (its lowest rank), allreduces between
// the leaders over Gloo, and broadcasts the result inside each host: only one copy of the data per
// host crosses the network. The other operations go to a flat Gloo group of every rank.
//
// Thread safety: as ProcessGroup.
#pragma once

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

  /// Number of hosts the ranks were grouped into (for tests and logs).
  int num_hosts() const { return num_hosts_; }

 protected:
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

  std::shared_ptr<Store> store_;
  int num_hosts_ = 1;
  std::shared_ptr<ProcessGroup> local_;    // shm, the ranks of this host
  std::shared_ptr<ProcessGroup> leaders_;  // gloo, one rank per host; null on non-leaders
  std::shared_ptr<ProcessGroup> flat_;     // gloo, every rank
  std::unique_ptr<shm::OpQueue> queue_;
};

}  // namespace shoal::comm
