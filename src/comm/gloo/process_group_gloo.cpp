#include "comm/gloo/process_group_gloo.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <thread>

#include "comm/native_backed_work.h"
#include "comm/peer_directory.h"
#include "compat/gloo_group.h"
#include "comm/timeouts.h"
#include "shoal/env.h"
#include "shoal/error.h"
#include "shoal/log.h"

namespace shoal::comm {
namespace {

// A tensor Gloo can reduce: the tensor itself, or a float32 copy of a bfloat16 one.
at::Tensor native_view(const at::Tensor& tensor) {
  return compat::GlooGroup::supports_dtype(tensor.scalar_type()) ? tensor
                                                                  : tensor.to(at::kFloat);
}

ReduceOp native_op(ReduceOp op) { return op == ReduceOp::kAvg ? ReduceOp::kSum : op; }

// The point-to-point tags of the ring reduce-scatter's and the allreduce schedules' messages: far
// above the tags users pass to send/recv (0 by default), so that they never match one of them.
constexpr int kRingReduceScatterTag = 0x5e0a0001;
constexpr int kAllreduceScheduleTag = 0x5e0a0002;

algorithms::AllreduceAlgorithm algorithm_from(const GlooOptions& options) {
  if (options.allreduce_algorithm) return *options.allreduce_algorithm;
  return *algorithms::allreduce_algorithm_from_name(env::choice(env::Var::kAllreduceAlgo));
}

// The PeerLink of one scheduled collective: c10d Gloo's point-to-point messages.
class GlooScheduleLink : public algorithms::PeerLink {
 public:
  using Post = std::function<std::shared_ptr<Work>(const at::Tensor&, int, bool)>;
  GlooScheduleLink(int rank, int size, Milliseconds timeout, Post post)
      : rank_(rank), size_(size), timeout_(timeout), post_(std::move(post)) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  // The receive is posted first: Gloo sends a message from the caller's thread when the peer's
  // receive is already known, and from its event loop thread (one more wake-up) otherwise.
  void exchange(const at::Tensor& send, int dst, const at::Tensor& recv, int src) override {
    std::shared_ptr<Work> received;
    if (recv.defined()) received = post_(recv, src, /*is_send=*/false);
    std::shared_ptr<Work> sent;
    if (send.defined()) sent = post_(send, dst, /*is_send=*/true);
    if (received) received->wait(timeout_);
    if (sent) sent->wait(timeout_);
  }

 private:
  int rank_;
  int size_;
  Milliseconds timeout_;
  Post post_;
};

// The bytes an allreduce of `tensor` moves per copy: bfloat16 travels as float32.
int64_t reduced_bytes(const at::Tensor& tensor) {
  const bool native = compat::GlooGroup::supports_dtype(tensor.scalar_type());
  return tensor.numel() * (native ? static_cast<int64_t>(tensor.element_size()) : 4);
}

int ranks_per_node_from(const GlooOptions& options, int size) {
  if (options.ranks_per_node > 0) return options.ranks_per_node;
  return options.hostname == "127.0.0.1" && options.interface.empty() ? size : 1;
}

}  // namespace

ProcessGroupGloo::ProcessGroupGloo(std::shared_ptr<Store> store, int rank, int size,
                                   Milliseconds timeout, GlooOptions options)
    : ProcessGroup(rank, size, timeout), store_(std::move(store)), options_(std::move(options)) {
  if (env::text(env::Var::kGlooReduceScatter)) {
    options_.ring_reduce_scatter = env::choice(env::Var::kGlooReduceScatter) == "ring";
  }
  allreduce_algorithm_ = algorithm_from(options_);
  // Other nodes are taken to have as many cores as this one.
  topology_ = {size, ranks_per_node_from(options_, size),
               static_cast<int>(std::thread::hardware_concurrency())};
  peers_ = std::make_shared<PeerDirectory>(store_, "shoal/gloo", rank, size);
  try {
    gloo_ = std::make_unique<compat::GlooGroup>(make_prefix_store("shoal/gloo/ctx", store_), rank,
                                                size, timeout, options_.hostname,
                                                options_.interface);
  } catch (const shoal::Error& e) {
    SHOAL_THROW(TimeoutError, rank_prefix(), " gloo: could not connect to every rank within ",
                timeout.count(), " ms: ", e.what());
  } catch (const std::exception& e) {
    std::string cause = e.what();
    SHOAL_THROW(PeerError, rank_prefix(), " gloo: could not connect to every rank: ",
                cause.substr(0, cause.find('\n')));
  }
}

ProcessGroupGloo::~ProcessGroupGloo() {
  if (gloo_ && broken_->load()) {
    log::debug(rank_prefix(), " gloo: an operation failed; leaving c10d's group to end with the "
               "process rather than wait for its threads");
    gloo_->abandon();
  }
}

void ProcessGroupGloo::abort(const std::string& /*reason*/) { broken_->store(true); }

std::shared_ptr<Work> ProcessGroupGloo::collective_work(const OpContext& ctx,
                                                        std::unique_ptr<compat::NativeWork> native,
                                                        std::function<void()> on_success) {
  auto work = std::make_shared<NativeBackedWork>(ctx, std::move(native), peers_, hang_reporter(),
                                                 std::move(on_success), /*watch_heartbeats=*/true);
  work->set_on_failure([broken = broken_] { broken->store(true); });
  return work;
}

std::shared_ptr<Work> ProcessGroupGloo::point_to_point_work(
    const OpContext& ctx, std::unique_ptr<compat::NativeWork> native) {
  auto work = std::make_shared<NativeBackedWork>(ctx, std::move(native), peers_, hang_reporter(),
                                                 nullptr);
  work->set_on_failure([broken = broken_] { broken->store(true); });
  return work;
}

algorithms::AllreduceAlgorithm ProcessGroupGloo::allreduce_algorithm_for(int64_t bytes) const {
  if (allreduce_algorithm_ != algorithms::AllreduceAlgorithm::kAuto) return allreduce_algorithm_;
  return algorithms::choose_allreduce_algorithm(bytes, topology_, cost_model_);
}

std::shared_ptr<Work> ProcessGroupGloo::scheduled_allreduce(algorithms::AllreduceAlgorithm algorithm,
                                                            at::Tensor& tensor, ReduceOp op,
                                                            const OpContext& ctx) {
  at::Tensor work = native_view(tensor);
  at::Tensor flat = work.reshape({-1});
  GlooScheduleLink link(rank(), size(), ctx.timeout,
                        [&](const at::Tensor& t, int peer, bool is_send) {
                          at::Tensor buffer = t;
                          return point_to_point_work(
                              ctx, is_send ? gloo_->send(buffer, peer, kAllreduceScheduleTag)
                                           : gloo_->recv(buffer, peer, kAllreduceScheduleTag));
                        });
  algorithms::allreduce_with(algorithm, flat, native_op(op), link);
  if (op == ReduceOp::kAvg) {
    if (flat.is_floating_point()) {
      flat.div_(size());
    } else {
      flat.floor_divide_(size());
    }
  }
  if (!work.is_same(tensor)) tensor.copy_(work);
  return make_completed_work(ctx.label);
}

std::shared_ptr<Work> ProcessGroupGloo::run_allreduce(at::Tensor& tensor, ReduceOp op,
                                                      const OpContext& ctx) {
  const algorithms::AllreduceAlgorithm algorithm =
      size() > 1 ? allreduce_algorithm_for(reduced_bytes(tensor)) : algorithms::AllreduceAlgorithm::kNative;
  last_allreduce_ = algorithm;
  if (algorithm != algorithms::AllreduceAlgorithm::kNative) {
    return scheduled_allreduce(algorithm, tensor, op, ctx);
  }
  at::Tensor work = native_view(tensor);
  auto native = gloo_->allreduce(work, native_op(op), ctx.timeout);
  const int n = size();
  return collective_work(ctx, std::move(native), [=]() mutable {
    if (op == ReduceOp::kAvg) {
      if (work.is_floating_point()) {
        work.div_(n);
      } else {
        work.floor_divide_(n);
      }
    }
    if (!work.is_same(tensor)) tensor.copy_(work);
  });
}

std::shared_ptr<Work> ProcessGroupGloo::run_broadcast(at::Tensor& tensor, int root,
                                                      const OpContext& ctx) {
  at::Tensor work = native_view(tensor);
  auto native = gloo_->broadcast(work, root, ctx.timeout);
  return collective_work(ctx, std::move(native), [=]() mutable {
    if (!work.is_same(tensor)) tensor.copy_(work);
  });
}

std::shared_ptr<Work> ProcessGroupGloo::run_reduce(at::Tensor& tensor, int root, ReduceOp op,
                                                   const OpContext& ctx) {
  at::Tensor work = native_view(tensor);
  auto native = gloo_->reduce(work, root, native_op(op), ctx.timeout);
  const int n = size();
  const bool is_root = rank() == root;
  return collective_work(ctx, std::move(native), [=]() mutable {
    if (!is_root) return;
    if (op == ReduceOp::kAvg) {
      if (work.is_floating_point()) {
        work.div_(n);
      } else {
        work.floor_divide_(n);
      }
    }
    if (!work.is_same(tensor)) tensor.copy_(work);
  });
}

std::shared_ptr<Work> ProcessGroupGloo::run_allgather(std::vector<at::Tensor>& outputs,
                                                      const at::Tensor& input,
                                                      const OpContext& ctx) {
  auto native = gloo_->allgather(outputs, input, ctx.timeout);
  return collective_work(ctx, std::move(native), nullptr);
}

std::shared_ptr<Work> ProcessGroupGloo::ring_reduce_scatter(at::Tensor& output,
                                                            std::vector<at::Tensor>& inputs,
                                                            ReduceOp op, const OpContext& ctx) {
  // Block k travels the ring from rank k+1 to rank k, each rank on the way adding its own: at
  // step s rank r sends block r-s-1 (its sum so far) to r+1 and receives block r-s-2 from r-1.
  // After N-1 steps it has received block r with every other rank's part in it. Runs on the
  // caller's thread (the Work it returns is complete); every wait is bounded by the op's time-out
  // and a failure names the peer (point_to_point_work).
  const int n = size();
  const int r = rank();
  const int next = (r + 1) % n;
  const int previous = (r + n - 1) % n;
  auto own = [&](int k) { return native_view(inputs[static_cast<size_t>((k % n + n) % n)].reshape({-1})); };
  at::Tensor sending = own(r - 1).clone();
  at::Tensor receiving = at::empty_like(sending);
  for (int s = 0; s < n - 1; ++s) {
    auto sent = point_to_point_work(ctx, gloo_->send(sending, next, kRingReduceScatterTag));
    auto received = point_to_point_work(ctx, gloo_->recv(receiving, previous, kRingReduceScatterTag));
    received->wait(ctx.timeout);
    sent->wait(ctx.timeout);
    const at::Tensor mine = own(r - s - 2);
    switch (native_op(op)) {
      case ReduceOp::kSum: receiving.add_(mine); break;
      case ReduceOp::kProduct: receiving.mul_(mine); break;
      case ReduceOp::kMin: at::minimum_out(receiving, receiving, mine); break;
      case ReduceOp::kMax: at::maximum_out(receiving, receiving, mine); break;
      default: SHOAL_THROW(InvalidArgument, ctx.prefix(), ": this reduction is not supported");
    }
    std::swap(sending, receiving);
  }
  if (op == ReduceOp::kAvg) {
    sending = sending.is_floating_point() ? sending / n : sending.floor_divide(n);
  }
  output.copy_(sending.view(output.sizes()));
  return make_completed_work(ctx.label);
}

std::shared_ptr<Work> ProcessGroupGloo::run_reduce_scatter(at::Tensor& output,
                                                           std::vector<at::Tensor>& inputs,
                                                           ReduceOp op, const OpContext& ctx) {
  if (options_.ring_reduce_scatter && size() > 1) return ring_reduce_scatter(output, inputs, op, ctx);
  // Gloo has no reduce_scatter: reduce all blocks, keep this rank's. Costs size() times the
  // traffic of a real one; the shm backend has the efficient version.
  std::vector<at::Tensor> flat_inputs;
  for (const auto& input : inputs) flat_inputs.push_back(input.reshape({-1}));
  at::Tensor flat = native_view(at::cat(flat_inputs));
  auto native = gloo_->allreduce(flat, native_op(op), ctx.timeout);
  const int n = size();
  const int64_t block = output.numel();
  const int64_t offset = block * rank();
  return collective_work(ctx, std::move(native), [=]() mutable {
    at::Tensor mine = flat.narrow(0, offset, block);
    if (op == ReduceOp::kAvg) {
      mine = mine.is_floating_point() ? mine / n : mine.floor_divide(n);
    }
    output.copy_(mine.view(output.sizes()));
  });
}

std::shared_ptr<Work> ProcessGroupGloo::run_gather(std::vector<at::Tensor>& outputs,
                                                   const at::Tensor& input, int root,
                                                   const OpContext& ctx) {
  std::vector<at::Tensor> none;
  auto native = gloo_->gather(rank() == root ? outputs : none, input, root, ctx.timeout);
  return collective_work(ctx, std::move(native), nullptr);
}

std::shared_ptr<Work> ProcessGroupGloo::run_scatter(at::Tensor& output,
                                                    std::vector<at::Tensor>& inputs, int root,
                                                    const OpContext& ctx) {
  std::vector<at::Tensor> none;
  auto native = gloo_->scatter(output, rank() == root ? inputs : none, root, ctx.timeout);
  return collective_work(ctx, std::move(native), nullptr);
}

std::shared_ptr<Work> ProcessGroupGloo::run_send(const at::Tensor& tensor, int dst, int tag,
                                                 const OpContext& ctx) {
  return point_to_point_work(ctx, gloo_->send(tensor, dst, tag));
}

std::shared_ptr<Work> ProcessGroupGloo::run_recv(at::Tensor& tensor, int src, int tag,
                                                 const OpContext& ctx) {
  return point_to_point_work(ctx, gloo_->recv(tensor, src, tag));
}

std::shared_ptr<Work> ProcessGroupGloo::run_barrier(const OpContext& ctx) {
  auto native = gloo_->barrier(ctx.timeout);
  return collective_work(ctx, std::move(native), nullptr);
}

std::shared_ptr<ProcessGroup> ProcessGroupGloo::run_new_group(const std::vector<int>& ranks,
                                                              int group_rank, uint64_t group_id) {
  auto sub_store = make_prefix_store("shoal/gloo/group" + std::to_string(group_id), store_);
  return std::make_shared<ProcessGroupGloo>(sub_store, group_rank, static_cast<int>(ranks.size()),
                                            timeout(), options_);
}

}  // namespace shoal::comm
