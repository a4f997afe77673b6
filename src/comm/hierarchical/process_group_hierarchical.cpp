#include "comm/hierarchical/process_group_hierarchical.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>

#include "comm/backends.h"
#include "comm/gloo/process_group_gloo.h"
#include "comm/peer_directory.h"
#include "comm/shm/op_queue.h"
#include "comm/shm/process_group_shm.h"
#include "shoal/env.h"
#include "shoal/error.h"

namespace shoal::comm {
namespace {

// Tag of the point-to-point messages inside a host (a leader passing a result to a root that is
// not the leader). Any value does: nothing else sends on the local group, and the worker thread
// issues them in order.
constexpr int kLocalTag = 0;

// The host name used for grouping: SHOAL_HOSTNAME (tests pretend to be several hosts), or the
// machine's.
std::string grouping_hostname() {
  return env::text(env::Var::kHostname).value_or(local_hostname());
}

// Sums go up the tree and are divided once at the end, so avg is exact in integers too.
ReduceOp stage_op(ReduceOp op) { return op == ReduceOp::kAvg ? ReduceOp::kSum : op; }

void divide_sum(at::Tensor& tensor, int n) {
  if (at::isFloatingType(tensor.scalar_type())) {
    tensor.div_(n);
  } else {
    tensor.copy_(at::div(tensor, n, "trunc"));
  }
}

// The bytes of a contiguous tensor: what Gloo moves for operations that do not reduce, in every
// dtype (c10d's Gloo moves no bfloat16) and without a conversion.
at::Tensor as_bytes(const at::Tensor& tensor) { return tensor.reshape({-1}).view(at::kByte); }

// Waits for operations that run at the same time, all within one `timeout`.
void wait_all(const std::vector<std::shared_ptr<Work>>& works, Milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (const auto& work : works) {
    const auto left = std::chrono::duration_cast<Milliseconds>(deadline -
                                                               std::chrono::steady_clock::now());
    work->wait(std::max(left, Milliseconds(1)));
  }
}

std::string join_ranks(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ",") + std::to_string(r);
  return out;
}

}  // namespace

ProcessGroupHierarchical::ProcessGroupHierarchical(std::shared_ptr<Store> store, int rank, int size,
                                                   Milliseconds timeout)
    : ProcessGroup(rank, size, timeout), store_(std::move(store)) {
  const std::string my_name = grouping_hostname();
  // "name real-host" per rank (the real host name, last, has no space), in O(1) requests per rank.
  const std::vector<std::string> records =
      gather_records(*store_, "hier/host", rank, size, my_name + " " + local_hostname());
  std::vector<std::string> hosts(size);
  bool one_real_host = true;
  for (int r = 0; r < size; ++r) {
    const size_t space = records[r].rfind(' ');
    hosts[r] = records[r].substr(0, space);
    one_real_host &= space != std::string::npos && records[r].substr(space + 1) == local_hostname();
  }
  // Hosts are numbered in order of their lowest rank; a host's leader is its lowest rank.
  std::map<std::string, int> host_index;
  host_of_.resize(size);
  local_rank_of_.resize(size);
  for (int r = 0; r < size; ++r) {
    auto [it, added] = host_index.emplace(hosts[r], static_cast<int>(host_ranks_.size()));
    if (added) host_ranks_.emplace_back();
    host_of_[r] = it->second;
    local_rank_of_[r] = static_cast<int>(host_ranks_[it->second].size());
    host_ranks_[it->second].push_back(r);
  }
  num_hosts_ = static_cast<int>(host_ranks_.size());
  my_host_ = host_of_[rank];
  local_rank_ = local_rank_of_[rank];
  local_size_ = static_cast<int>(host_ranks_[my_host_].size());
  std::vector<int> leader_ranks;
  int first = 0;
  for (const auto& ranks : host_ranks_) {
    even_hosts_ &= ranks.size() == host_ranks_[0].size();
    max_local_size_ = std::max(max_local_size_, static_cast<int>(ranks.size()));
    host_first_.push_back(first);
    first += static_cast<int>(ranks.size());
    leader_ranks.push_back(ranks[0]);
  }
  layout_ = detail::str_cat(" [local group: ranks ", join_ranks(host_ranks_[my_host_]), " on '",
                            my_name, "'; leader group: ranks ", join_ranks(leader_ranks), "]");

  GlooOptions gloo;
  if (const auto iface = env::text(env::Var::kGlooSocketIfname)) gloo.interface = *iface;
  gloo.hostname = one_real_host ? "127.0.0.1" : local_hostname();

  local_ = std::make_shared<shm::ProcessGroupShm>(
      store_, "hier/local/" + std::to_string(my_host_), local_rank_, local_size_, timeout);
  if (local_rank_ == 0) {
    GlooOptions leader_options = gloo;
    leader_options.ranks_per_node = 1;  // one leader per host: every message crosses hosts
    leaders_ = std::make_shared<ProcessGroupGloo>(make_prefix_store("hier/leaders", store_),
                                                  my_host_, num_hosts_, timeout, leader_options);
  }
  flat_ = std::make_shared<ProcessGroupGloo>(make_prefix_store("hier/flat", store_), rank, size,
                                             timeout, gloo);
  // A time-out inside a sub-group names every member's last operations (its own numbering);
  // the sub-groups share this process's heartbeat, that of its job rank.
  local_->enable_hang_reports(store_, "hier/hang/local/" + std::to_string(my_host_),
                              host_ranks_[my_host_]);
  if (leaders_) leaders_->enable_hang_reports(store_, "hier/hang/leaders", leader_ranks);
  flat_->enable_hang_reports(store_, "hier/hang/flat");
  queue_ = std::make_shared<shm::OpQueue>("hierarchical");
  // No rank may use or drop its sub-groups before every rank has finished connecting all of
  // them: a rank tearing down its Gloo groups early can strand a peer still connecting to it.
  flat_->barrier({timeout})->wait();
}

ProcessGroupHierarchical::~ProcessGroupHierarchical() {
  queue_->stop();  // also when a waiting thread still holds the queue
  queue_.reset();
}

bool ProcessGroupHierarchical::is_symmetric(const at::Tensor& tensor) const {
  return num_hosts_ == 1 && local_->is_symmetric(tensor);
}

at::Tensor ProcessGroupHierarchical::run_empty_symmetric(int64_t numel, at::ScalarType dtype,
                                                         const OpContext& ctx) {
  // Across hosts the leaders' stage copies anyway, so only one host gains from shared memory.
  if (num_hosts_ == 1) return local_->empty_symmetric(numel, dtype, ctx.timeout);
  return ProcessGroup::run_empty_symmetric(numel, dtype, ctx);
}

void ProcessGroupHierarchical::abort(const std::string& reason) {
  local_->abort(reason);
  if (leaders_) leaders_->abort(reason);
  flat_->abort(reason);
}

std::shared_ptr<Work> ProcessGroupHierarchical::submit(const OpContext& ctx,
                                                       std::function<void()> body) {
  // At most three stages run one after the other, each within the operation's time-out.
  auto work =
      std::make_shared<shm::ShmWork>(ctx.label, ctx.timeout * 3 + Milliseconds(1000), queue_);
  queue_->enqueue([this, work, body = std::move(body)] {
    const OpLabel& label = work->label();
    try {
      try {
        body();
      } catch (const TimeoutError& e) {
        throw TimeoutError(label.prefix() + " failed: " + e.what() + layout_, e.location());
      } catch (const PeerError& e) {
        throw PeerError(label.prefix() + " failed: " + e.what() + layout_, e.location());
      } catch (const InvalidArgument& e) {
        throw InvalidArgument(label.prefix() + " failed: " + e.what() + layout_, e.location());
      } catch (const Error& e) {
        throw Error(label.prefix() + " failed: " + e.what() + layout_, e.location());
      }
      work->finish();
    } catch (const std::exception& e) {
      // The other ranks of this host may be waiting for this one (a leader, most often): abort
      // so that they fail at once with this reason rather than time out blaming this rank.
      abort(e.what());
      work->finish(std::current_exception());
    } catch (...) {
      abort(label.prefix() + " failed");
      work->finish(std::current_exception());
    }
  }, work.get());
  return work;
}

int64_t ProcessGroupHierarchical::padded_offset(int r, int64_t numel) const {
  return (static_cast<int64_t>(host_of_[r]) * max_local_size_ + local_rank_of_[r]) * numel;
}

int64_t ProcessGroupHierarchical::packed_offset(int r, int64_t numel) const {
  return (static_cast<int64_t>(host_first_[host_of_[r]]) + local_rank_of_[r]) * numel;
}

void ProcessGroupHierarchical::unpack(const at::Tensor& blocks, std::vector<at::Tensor>& outputs,
                                      bool padded) const {
  const int64_t n = outputs[0].numel();
  for (int r = 0; r < size(); ++r) {
    const int64_t offset = padded ? padded_offset(r, n) : packed_offset(r, n);
    outputs[r].copy_(blocks.narrow(0, offset, n).view(outputs[r].sizes()));
  }
}

std::vector<at::Tensor> ProcessGroupHierarchical::padded_parts(const at::Tensor& blocks,
                                                               int64_t host_block, int num_hosts) {
  std::vector<at::Tensor> parts;
  for (int h = 0; h < num_hosts; ++h) {
    parts.push_back(as_bytes(blocks.narrow(0, h * host_block, host_block)));
  }
  return parts;
}

void ProcessGroupHierarchical::gather_on_leader(const at::Tensor& input,
                                                std::vector<at::Tensor> views,
                                                Milliseconds timeout) {
  if (local_size_ > 1) {
    local_->gather(views, input, {0, timeout})->wait();
  } else {
    views[0].copy_(input);
  }
}

void ProcessGroupHierarchical::scatter_from_leader(at::Tensor& output,
                                                   std::vector<at::Tensor> views,
                                                   Milliseconds timeout) {
  if (local_size_ > 1) {
    local_->scatter(output, views, {0, timeout})->wait();
  } else {
    output.copy_(views[0]);
  }
}

std::vector<at::Tensor> ProcessGroupHierarchical::local_views(const at::Tensor& local_block,
                                                              const at::Tensor& like) const {
  const int64_t n = like.numel();
  std::vector<at::Tensor> views;
  for (int i = 0; i < local_size_; ++i) {
    views.push_back(local_block.narrow(0, i * n, n).view(like.sizes()));
  }
  return views;
}

// ---- the collectives' stages (worker thread) ---------------------------------------------------
// Every rank of a host issues the same collectives on the local group, in the same order, and
// the leaders the same collectives on the leader group; beyond that, only a leader and a root
// that is not the leader exchange a message over the local group. A host of one rank skips its
// local stages.

void ProcessGroupHierarchical::allreduce_tree(at::Tensor& tensor, ReduceOp op,
                                              Milliseconds timeout) {
  if (num_hosts_ == 1) {
    local_->allreduce(tensor, {op, timeout})->wait();
    return;
  }
  if (local_size_ > 1) local_->reduce(tensor, {0, stage_op(op), timeout})->wait();
  if (is_leader()) {
    leaders_->allreduce(tensor, {stage_op(op), timeout})->wait();
    if (op == ReduceOp::kAvg) divide_sum(tensor, size());
  }
  if (local_size_ > 1) local_->broadcast(tensor, {0, timeout})->wait();
}

void ProcessGroupHierarchical::broadcast_tree(at::Tensor& tensor, int root, Milliseconds timeout) {
  if (num_hosts_ == 1) {
    local_->broadcast(tensor, {root, timeout})->wait();
    return;
  }
  const int root_host = host_of_[root];
  at::Tensor bytes = as_bytes(tensor);
  if (my_host_ == root_host) {
    // One local broadcast from the root reaches its leader and the rest of the host at once.
    if (local_size_ > 1) local_->broadcast(tensor, {local_rank_of_[root], timeout})->wait();
    if (is_leader()) leaders_->broadcast(bytes, {root_host, timeout})->wait();
  } else {
    if (is_leader()) leaders_->broadcast(bytes, {root_host, timeout})->wait();
    if (local_size_ > 1) local_->broadcast(tensor, {0, timeout})->wait();
  }
}

void ProcessGroupHierarchical::reduce_tree(at::Tensor& tensor, int root, ReduceOp op,
                                           Milliseconds timeout) {
  if (num_hosts_ == 1) {
    local_->reduce(tensor, {root, op, timeout})->wait();
    return;
  }
  const int root_host = host_of_[root];
  if (local_size_ > 1) local_->reduce(tensor, {0, stage_op(op), timeout})->wait();
  if (is_leader()) {
    leaders_->reduce(tensor, {root_host, stage_op(op), timeout})->wait();
    if (my_host_ != root_host) return;
    if (op == ReduceOp::kAvg) divide_sum(tensor, size());
    if (rank() != root) local_->send(tensor, local_rank_of_[root], {kLocalTag, timeout})->wait();
  } else if (rank() == root) {
    local_->recv(tensor, 0, {kLocalTag, timeout})->wait();
  }
}

void ProcessGroupHierarchical::allgather_tree(std::vector<at::Tensor>& outputs,
                                              const at::Tensor& input, Milliseconds timeout) {
  if (num_hosts_ == 1) {
    local_->allgather(outputs, input, {timeout})->wait();
    return;
  }
  const int64_t n = input.numel();
  at::Tensor blocks = at::empty({size() * n}, input.options());  // every host's part (packed)
  const at::Tensor mine =
      is_leader() ? at::empty({local_size_ * n}, input.options()) : at::Tensor();
  gather_on_leader(input, is_leader() ? local_views(mine, input) : std::vector<at::Tensor>{},
                   timeout);
  if (is_leader()) {
    std::vector<at::Tensor> parts;
    for (int h = 0; h < num_hosts_; ++h) {
      const int64_t count = static_cast<int64_t>(host_ranks_[h].size()) * n;
      parts.push_back(as_bytes(blocks.narrow(0, host_first_[h] * n, count)));
    }
    if (even_hosts_) {
      leaders_->allgather(parts, as_bytes(mine), {timeout})->wait();
    } else {
      // Gloo's allgather takes equal parts, and padding the smaller hosts' would send the
      // padding too (3 + 1 ranks: as many bytes as a flat allgather). One broadcast per host
      // from its leader moves the exact parts, as many bytes as a ring, issued back to back.
      blocks.narrow(0, host_first_[my_host_] * n, local_size_ * n).copy_(mine);
      std::vector<std::shared_ptr<Work>> broadcasts;
      for (int h = 0; h < num_hosts_; ++h) {
        broadcasts.push_back(leaders_->broadcast(parts[h], {h, timeout}));
      }
      wait_all(broadcasts, timeout);
    }
  }
  if (local_size_ > 1) local_->broadcast(blocks, {0, timeout})->wait();
  unpack(blocks, outputs);
}

void ProcessGroupHierarchical::gather_tree(std::vector<at::Tensor>& outputs,
                                           const at::Tensor& input, int root,
                                           Milliseconds timeout) {
  if (num_hosts_ == 1) {
    local_->gather(outputs, input, {root, timeout})->wait();
    return;
  }
  const int root_host = host_of_[root];
  const int64_t n = input.numel();
  const int64_t host_block = max_local_size_ * n;
  // On the root's leader, then on the root: every host's part, padded to the largest host (Gloo's
  // gather takes equal parts; no padding when the hosts are even).
  at::Tensor blocks;
  if (my_host_ == root_host && (is_leader() || rank() == root)) {
    blocks = at::empty({num_hosts_ * host_block}, input.options());
  }
  const at::Tensor mine = is_leader() ? at::empty({host_block}, input.options()) : at::Tensor();
  gather_on_leader(input, is_leader() ? local_views(mine, input) : std::vector<at::Tensor>{},
                   timeout);
  if (is_leader()) {
    std::vector<at::Tensor> host_blocks;
    if (my_host_ == root_host) host_blocks = padded_parts(blocks, host_block, num_hosts_);
    leaders_->gather(host_blocks, as_bytes(mine), {root_host, timeout})->wait();
    if (my_host_ == root_host && rank() != root) {
      local_->send(blocks, local_rank_of_[root], {kLocalTag, timeout})->wait();
    }
  } else if (rank() == root) {
    local_->recv(blocks, 0, {kLocalTag, timeout})->wait();
  }
  if (rank() == root) unpack(blocks, outputs, /*padded=*/true);
}

void ProcessGroupHierarchical::scatter_tree(at::Tensor& output, std::vector<at::Tensor>& inputs,
                                            int root, Milliseconds timeout) {
  if (num_hosts_ == 1) {
    local_->scatter(output, inputs, {root, timeout})->wait();
    return;
  }
  const int root_host = host_of_[root];
  const int64_t n = output.numel();
  const int64_t host_block = max_local_size_ * n;
  // On the root and its leader: the inputs as host parts, padded to the largest host (as in
  // gather_tree).
  at::Tensor blocks;
  if (rank() == root) {
    blocks = at::empty({num_hosts_ * host_block}, output.options());
    for (int r = 0; r < size(); ++r) {
      blocks.narrow(0, padded_offset(r, n), n).copy_(inputs[r].reshape({-1}));
    }
    if (!is_leader()) local_->send(blocks, 0, {kLocalTag, timeout})->wait();
  }
  if (!is_leader()) {
    scatter_from_leader(output, {}, timeout);
    return;
  }
  if (my_host_ == root_host && rank() != root) {
    blocks = at::empty({num_hosts_ * host_block}, output.options());
    local_->recv(blocks, local_rank_of_[root], {kLocalTag, timeout})->wait();
  }
  std::vector<at::Tensor> host_blocks;
  if (my_host_ == root_host) host_blocks = padded_parts(blocks, host_block, num_hosts_);
  at::Tensor mine = at::empty({host_block}, output.options());
  at::Tensor mine_bytes = as_bytes(mine);
  leaders_->scatter(mine_bytes, host_blocks, {root_host, timeout})->wait();
  scatter_from_leader(output, local_views(mine, output), timeout);
}

void ProcessGroupHierarchical::reduce_scatter_tree(at::Tensor& output,
                                                   std::vector<at::Tensor>& inputs, ReduceOp op,
                                                   Milliseconds timeout) {
  if (num_hosts_ == 1) {
    local_->reduce_scatter(output, inputs, {op, timeout})->wait();
    return;
  }
  const int64_t n = output.numel();
  std::vector<at::Tensor> flat_inputs;
  for (const auto& input : inputs) flat_inputs.push_back(input.reshape({-1}));
  at::Tensor all = at::cat(flat_inputs);  // every rank's block, in rank order
  if (local_size_ > 1) local_->reduce(all, {0, stage_op(op), timeout})->wait();
  if (is_leader()) {
    // Gloo has no reduce_scatter: the leaders allreduce every block, each keeps its host's. That
    // moves twice a true reduce_scatter's bytes, but once per host instead of once per rank.
    leaders_->allreduce(all, {stage_op(op), timeout})->wait();
    std::vector<at::Tensor> views;
    for (int r : host_ranks_[my_host_]) {
      views.push_back(all.narrow(0, r * n, n).view(output.sizes()));
    }
    scatter_from_leader(output, std::move(views), timeout);
  } else {
    scatter_from_leader(output, {}, timeout);
  }
  if (op == ReduceOp::kAvg) divide_sum(output, size());
}

void ProcessGroupHierarchical::barrier_tree(Milliseconds timeout) {
  if (num_hosts_ == 1) {
    local_->barrier({timeout})->wait();
    return;
  }
  // Every rank of a host has arrived, then every host, then the host learns it.
  if (local_size_ > 1) local_->barrier({timeout})->wait();
  if (is_leader()) leaders_->barrier({timeout})->wait();
  if (local_size_ > 1) local_->barrier({timeout})->wait();
}

// ---- ProcessGroup's operations -----------------------------------------------------------------

std::shared_ptr<Work> ProcessGroupHierarchical::run_allreduce(at::Tensor& tensor, ReduceOp op,
                                                              const OpContext& ctx) {
  return submit(ctx, [this, tensor, op, timeout = ctx.timeout]() mutable {
    allreduce_tree(tensor, op, timeout);
  });
}

std::shared_ptr<Work> ProcessGroupHierarchical::run_broadcast(at::Tensor& tensor, int root,
                                                              const OpContext& ctx) {
  return submit(ctx, [this, tensor, root, timeout = ctx.timeout]() mutable {
    broadcast_tree(tensor, root, timeout);
  });
}

std::shared_ptr<Work> ProcessGroupHierarchical::run_reduce(at::Tensor& tensor, int root,
                                                           ReduceOp op, const OpContext& ctx) {
  return submit(ctx, [this, tensor, root, op, timeout = ctx.timeout]() mutable {
    reduce_tree(tensor, root, op, timeout);
  });
}

std::shared_ptr<Work> ProcessGroupHierarchical::run_allgather(std::vector<at::Tensor>& outputs,
                                                              const at::Tensor& input,
                                                              const OpContext& ctx) {
  return submit(ctx, [this, outputs, input, timeout = ctx.timeout]() mutable {
    allgather_tree(outputs, input, timeout);
  });
}

std::shared_ptr<Work> ProcessGroupHierarchical::run_reduce_scatter(at::Tensor& output,
                                                                   std::vector<at::Tensor>& inputs,
                                                                   ReduceOp op,
                                                                   const OpContext& ctx) {
  return submit(ctx, [this, output, inputs, op, timeout = ctx.timeout]() mutable {
    reduce_scatter_tree(output, inputs, op, timeout);
  });
}

std::shared_ptr<Work> ProcessGroupHierarchical::run_gather(std::vector<at::Tensor>& outputs,
                                                           const at::Tensor& input, int root,
                                                           const OpContext& ctx) {
  return submit(ctx, [this, outputs, input, root, timeout = ctx.timeout]() mutable {
    gather_tree(outputs, input, root, timeout);
  });
}

std::shared_ptr<Work> ProcessGroupHierarchical::run_scatter(at::Tensor& output,
                                                            std::vector<at::Tensor>& inputs,
                                                            int root, const OpContext& ctx) {
  return submit(ctx, [this, output, inputs, root, timeout = ctx.timeout]() mutable {
    scatter_tree(output, inputs, root, timeout);
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
  return submit(ctx, [this, timeout] { barrier_tree(timeout); });
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
