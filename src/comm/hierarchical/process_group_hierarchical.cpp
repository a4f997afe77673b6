#include "comm/hierarchical/process_group_hierarchical.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <map>

#include "comm/backends.h"
#include "comm/gloo/process_group_gloo.h"
#include "comm/peer_directory.h"
#include "comm/shm/op_queue.h"
#include "comm/shm/process_group_shm.h"
#include "shoal/error.h"

namespace shoal::comm {
namespace {

// The host name used for grouping: SHOAL_HOSTNAME (tests pretend to be several hosts), or the
// machine's.
std::string grouping_hostname() {
  const char* fake = std::getenv("SHOAL_HOSTNAME");
  return (fake != nullptr && *fake != '\0') ? fake : local_hostname();
}

}  // namespace

ProcessGroupHierarchical::ProcessGroupHierarchical(std::shared_ptr<Store> store, int rank, int size,
                                                   Milliseconds timeout)
    : ProcessGroup(rank, size, timeout), store_(std::move(store)) {
  const std::string me = std::to_string(rank);
  store_->set_string("hier/host/" + me, grouping_hostname());
  store_->set_string("hier/real_host/" + me, local_hostname());
  std::vector<std::string> hosts(size);
  bool one_real_host = true;
  for (int r = 0; r < size; ++r) {
    hosts[r] = store_->get_string("hier/host/" + std::to_string(r));
    one_real_host &= store_->get_string("hier/real_host/" + std::to_string(r)) == local_hostname();
  }
  // Hosts are numbered in order of their lowest rank; a host's leader is its lowest rank.
  std::map<std::string, int> host_index;
  std::vector<int> leaders;
  for (int r = 0; r < size; ++r) {
    if (host_index.emplace(hosts[r], static_cast<int>(leaders.size())).second) leaders.push_back(r);
  }
  num_hosts_ = static_cast<int>(leaders.size());
  const int my_host = host_index[hosts[rank]];
  int local_rank = 0, local_size = 0;
  for (int r = 0; r < size; ++r) {
    if (hosts[r] == hosts[rank]) {
      if (r < rank) ++local_rank;
      ++local_size;
    }
  }

  GlooOptions gloo;
  if (const char* iface = std::getenv("GLOO_SOCKET_IFNAME")) gloo.interface = iface;
  gloo.hostname = one_real_host ? "127.0.0.1" : local_hostname();

  local_ = std::make_shared<shm::ProcessGroupShm>(
      store_, "hier/local/" + std::to_string(my_host), local_rank, local_size, timeout);
  if (local_rank == 0) {
    leaders_ = std::make_shared<ProcessGroupGloo>(make_prefix_store("hier/leaders", store_),
                                                  my_host, num_hosts_, timeout, gloo);
  }
  flat_ = std::make_shared<ProcessGroupGloo>(make_prefix_store("hier/flat", store_), rank, size,
                                             timeout, gloo);
  queue_ = std::make_unique<shm::OpQueue>("hierarchical");
  // No rank may use or drop its sub-groups before every rank has finished connecting all of
  // them: a rank tearing down its Gloo groups early can strand a peer still connecting to it.
  flat_->barrier({timeout})->wait();
}

ProcessGroupHierarchical::~ProcessGroupHierarchical() { queue_.reset(); }

void ProcessGroupHierarchical::abort(const std::string& reason) {
  local_->abort(reason);
  if (leaders_) leaders_->abort(reason);
  flat_->abort(reason);
}

std::shared_ptr<Work> ProcessGroupHierarchical::submit(const OpContext& ctx,
                                                       std::function<void()> body) {
  auto work = std::make_shared<shm::ShmWork>(ctx.sequence, ctx.description, ctx.prefix,
                                             ctx.timeout * 3 + Milliseconds(1000));
  queue_->enqueue([work, prefix = ctx.prefix, body = std::move(body)] {
    try {
      try {
        body();
      } catch (const TimeoutError& e) {
        throw TimeoutError(prefix + " failed: " + e.what(), e.location());
      } catch (const PeerError& e) {
        throw PeerError(prefix + " failed: " + e.what(), e.location());
      } catch (const InvalidArgument& e) {
        throw InvalidArgument(prefix + " failed: " + e.what(), e.location());
      } catch (const Error& e) {
        throw Error(prefix + " failed: " + e.what(), e.location());
      }
      work->finish();
    } catch (...) {
      work->finish(std::current_exception());
    }
  });
  return work;
}

std::shared_ptr<Work> ProcessGroupHierarchical::run_allreduce(at::Tensor& tensor, ReduceOp op,
                                                              const OpContext& ctx) {
  const Milliseconds timeout = ctx.timeout;
  return submit(ctx, [this, tensor, op, timeout]() mutable {
    // Sums go up the tree and are divided once at the top, so avg is exact in integers too.
    const ReduceOp stage_op = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
    local_->reduce(tensor, {0, stage_op, timeout})->wait();
    if (leaders_) {
      if (num_hosts_ > 1) leaders_->allreduce(tensor, {stage_op, timeout})->wait();
      if (op == ReduceOp::kAvg) {
        if (at::isFloatingType(tensor.scalar_type())) {
          tensor.div_(size());
        } else {
          tensor.copy_(at::div(tensor, size(), "trunc"));
        }
      }
    }
    local_->broadcast(tensor, {0, timeout})->wait();
  });
}

std::shared_ptr<Work> ProcessGroupHierarchical::run_broadcast(at::Tensor& tensor, int root,
                                                              const OpContext& ctx) {
  const Milliseconds timeout = ctx.timeout;
  return submit(ctx, [this, tensor, root, timeout]() mutable {
    flat_->broadcast(tensor, {root, timeout})->wait();
  });
}

std::shared_ptr<Work> ProcessGroupHierarchical::run_reduce(at::Tensor& tensor, int root,
                                                           ReduceOp op, const OpContext& ctx) {
  const Milliseconds timeout = ctx.timeout;
  return submit(ctx, [this, tensor, root, op, timeout]() mutable {
    flat_->reduce(tensor, {root, op, timeout})->wait();
  });
}

std::shared_ptr<Work> ProcessGroupHierarchical::run_allgather(std::vector<at::Tensor>& outputs,
                                                              const at::Tensor& input,
                                                              const OpContext& ctx) {
  const Milliseconds timeout = ctx.timeout;
  return submit(ctx, [this, outputs, input, timeout]() mutable {
    flat_->allgather(outputs, input, {timeout})->wait();
  });
}

std::shared_ptr<Work> ProcessGroupHierarchical::run_reduce_scatter(at::Tensor& output,
                                                                   std::vector<at::Tensor>& inputs,
                                                                   ReduceOp op,
                                                                   const OpContext& ctx) {
  const Milliseconds timeout = ctx.timeout;
  return submit(ctx, [this, output, inputs, op, timeout]() mutable {
    flat_->reduce_scatter(output, inputs, {op, timeout})->wait();
  });
}

std::shared_ptr<Work> ProcessGroupHierarchical::run_gather(std::vector<at::Tensor>& outputs,
                                                           const at::Tensor& input, int root,
                                                           const OpContext& ctx) {
  const Milliseconds timeout = ctx.timeout;
  return submit(ctx, [this, outputs, input, root, timeout]() mutable {
    flat_->gather(outputs, input, {root, timeout})->wait();
  });
}

std::shared_ptr<Work> ProcessGroupHierarchical::run_scatter(at::Tensor& output,
                                                            std::vector<at::Tensor>& inputs,
                                                            int root, const OpContext& ctx) {
  const Milliseconds timeout = ctx.timeout;
  return submit(ctx, [this, output, inputs, root, timeout]() mutable {
    flat_->scatter(output, inputs, {root, timeout})->wait();
  });
}

// Point-to-point goes straight to the flat group: queued behind each other on one thread, a ring
// of blocking sends could deadlock.
std::shared_ptr<Work> ProcessGroupHierarchical::run_send(const at::Tensor& tensor, int dst, int tag,
                                                         const OpContext& ctx) {
  return flat_->send(tensor, dst, {tag, ctx.timeout});
}

std::shared_ptr<Work> ProcessGroupHierarchical::run_recv(at::Tensor& tensor, int src, int tag,
                                                         const OpContext& ctx) {
  return flat_->recv(tensor, src, {tag, ctx.timeout});
}

std::shared_ptr<Work> ProcessGroupHierarchical::run_barrier(const OpContext& ctx) {
  const Milliseconds timeout = ctx.timeout;
  return submit(ctx, [this, timeout] { flat_->barrier({timeout})->wait(); });
}

std::shared_ptr<ProcessGroup> ProcessGroupHierarchical::run_new_group(const std::vector<int>& ranks,
                                                                      int group_rank,
                                                                      uint64_t group_id) {
  return std::make_shared<ProcessGroupHierarchical>(
      make_prefix_store("hier/g" + std::to_string(group_id), store_), group_rank,
      static_cast<int>(ranks.size()), timeout());
}

std::shared_ptr<ProcessGroup> create_hierarchical_backend(const BackendArgs& args) {
  return std::make_shared<ProcessGroupHierarchical>(args.store, args.rank, args.size,
                                                    args.timeout);
}

}  // namespace shoal::comm
