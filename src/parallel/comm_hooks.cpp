#include "shoal/parallel/comm_hooks.h"

#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <mutex>

#include "shoal/error.h"

namespace shoal::parallel {
namespace {

// A Work that runs a continuation once, on the first successful wait.
class ThenWork : public comm::Work {
 public:
  ThenWork(std::shared_ptr<comm::Work> inner, std::function<void()> then)
      : comm::Work(inner->label()),
        inner_(std::move(inner)),
        then_(std::move(then)) {}

  bool is_completed() override { return inner_->is_completed(); }
  std::exception_ptr exception() override { return inner_->exception(); }
  void wait(comm::Milliseconds timeout) override {
    inner_->wait(timeout);
    std::lock_guard<std::mutex> lock(mutex_);
    if (!done_) {
      then_();
      done_ = true;
    }
  }

 private:
  std::shared_ptr<comm::Work> inner_;
  std::function<void()> then_;
  std::mutex mutex_;
  bool done_ = false;
};

CommHook compress_hook(std::shared_ptr<comm::ProcessGroup> group, at::ScalarType wire_type) {
  SHOAL_CHECK_T(InvalidArgument, group != nullptr, "comm hook: the process group is null");
  return [group, wire_type](GradBucket& bucket) {
    torch::NoGradGuard no_grad;
    // Divide before the sum (as PyTorch does) so that the reduced half-precision values stay in range.
    auto compressed = bucket.buffer().to(wire_type).div_(group->size());
    comm::AllreduceOptions options;
    options.check = false;  // identical on every rank by construction, as in allreduce_hook
    options.note = bucket.note().c_str();
    auto work = group->allreduce(compressed, options);
    at::Tensor buffer = bucket.buffer();
    return then(std::move(work), [buffer, compressed]() mutable {
      torch::NoGradGuard no_grad;
      buffer.copy_(compressed);
    });
  };
}

// PyTorch's fp16/bf16_compress_wrapper: `hook` runs on the bucket cast to `wire_type`; its result
// is cast back into the bucket.
CommHook compress_wrapper(at::ScalarType wire_type, CommHook hook) {
  SHOAL_CHECK_T(InvalidArgument, hook != nullptr, "compress wrapper: the hook is empty");
  return [wire_type, hook](GradBucket& bucket) {
    at::Tensor original = bucket.buffer();
    bucket.buffer() = original.to(wire_type);
    auto work = hook(bucket);
    return then(std::move(work), [&bucket, original]() mutable {
      torch::NoGradGuard no_grad;
      original.copy_(bucket.buffer());
      bucket.buffer() = original;
    });
  };
}

}  // namespace

std::shared_ptr<comm::Work> then(std::shared_ptr<comm::Work> work, std::function<void()> then) {
  SHOAL_CHECK_T(InvalidArgument, work != nullptr, "then(): the work is null");
  return std::make_shared<ThenWork>(std::move(work), std::move(then));
}

CommHook allreduce_hook(std::shared_ptr<comm::ProcessGroup> group, bool async_op) {
  SHOAL_CHECK_T(InvalidArgument, group != nullptr, "allreduce_hook: the process group is null");
  return [group, async_op](GradBucket& bucket) {
    // Averaging inside the collective: the shm backend divides in the same pass that sums (one
    // pass over the bucket fewer on the training thread than dividing first, as PyTorch does);
    // other backends divide the summed result. float32 gradients do not overflow either way.
    comm::AllreduceOptions options;
    options.op = comm::ReduceOp::kAvg;
    // The buckets are the same on every rank by construction (DDP verified the parameters and
    // every rank builds the same buckets), so the per-collective check would only add a blocking
    // round trip before each bucket's reduction.
    options.check = false;
    options.note = bucket.note().c_str();
    options.async_op = async_op;
    return group->allreduce(bucket.buffer(), options);
  };
}

CommHook fp16_compress_hook(std::shared_ptr<comm::ProcessGroup> group) {
  return compress_hook(std::move(group), at::kHalf);
}

CommHook bf16_compress_hook(std::shared_ptr<comm::ProcessGroup> group) {
  return compress_hook(std::move(group), at::kBFloat16);
}


CommHook fp16_compress_wrapper(CommHook hook) {
  return compress_wrapper(at::kHalf, std::move(hook));
}

CommHook bf16_compress_wrapper(CommHook hook) {
  return compress_wrapper(at::kBFloat16, std::move(hook));
}

namespace {

// PyTorch's _orthogonalize on a (1, n, r) matrix, in place: Gram-Schmidt for r <= 2 and half
// types, QR otherwise (the same operations, so the same numbers, as PyTorch's hook).
void orthogonalize(const at::Tensor& matrices, double epsilon) {
  static constexpr int64_t kRows[] = {1};  // the dimension each column's entries run along
  const int64_t columns = matrices.size(2);
  const auto dtype = matrices.scalar_type();
  if (columns > 2 && dtype != at::kHalf && dtype != at::kBFloat16) {
    matrices.copy_(std::get<0>(torch::linalg_qr(matrices, "reduced")));
    return;
  }
  for (int64_t i = 0; i < columns; ++i) {
    auto column = matrices.narrow(2, i, 1);
    auto norm = torch::linalg_vector_norm(column, 2, at::IntArrayRef(kRows), /*keepdim=*/true);
    if (epsilon == 0) {
      column.div_(norm);
    } else {
      column.div_(norm + epsilon);
    }
    if (i + 1 < columns) {
      auto rest = matrices.narrow(2, i + 1, columns - i - 1);
      rest.sub_((column * rest).sum(at::IntArrayRef(kRows), /*keepdim=*/true) * column);
    }
  }
}

// PyTorch's state.rng.randint(1_000_000_000), with state.rng = numpy's RandomState(random_seed):
// MT19937 seeded like std::mt19937, draws masked to 30 bits until one is below 10^9.
uint64_t next_q_seed(PowerSGDState& state) {
  if (!state.rng_seeded) {
    state.rng.seed(static_cast<std::mt19937::result_type>(state.random_seed & 0xffffffffu));
    state.rng_seeded = true;
  }
  constexpr uint32_t kBound = 1'000'000'000, kMask = (1u << 30) - 1;
  uint32_t value = 0;
  do {
    value = static_cast<uint32_t>(state.rng()) & kMask;
  } while (value >= kBound);
  return value;
}

// A tensor of `sizes` like `like`, kept in `cache[index]` from step to step.
at::Tensor reused(std::map<size_t, at::Tensor>& cache, size_t index, at::IntArrayRef sizes,
                  const at::Tensor& like) {
  at::Tensor& t = cache[index];
  if (!t.defined() || t.sizes() != sizes || t.options().dtype() != like.options().dtype() ||
      t.device() != like.device()) {
    t = torch::empty(sizes, like.options());
  }
  return t;
}

// One bucket's PowerSGD step between the hook and its wait.
struct PowerSgdBucket {
  size_t index = 0;
  at::Tensor buffer;                     // the bucket's current buffer (a wrapper may replace it)
  at::Tensor input_copy;                 // the gradients with the error added, for feedback
  std::vector<at::Tensor> matrices;      // (1, n, m) views of the bucket, grouped by shape
  int64_t p_total = 0, q_total = 0;      // elements of every P, every Q
  at::Tensor p_memory, q_memory;         // all Ps, all Qs, flat
  std::vector<at::Tensor> ps, qs;        // (1, n, r) and (1, m, r) views into the P, Q memories
  at::Tensor uncompressed_memory;        // the other tensors, flattened, reduced whole
  std::vector<at::Tensor> uncompressed;  // their views in the bucket
  std::shared_ptr<comm::Work> uncompressed_work;
};

// Adds the error left by the previous step's approximation and keeps the sum to compute the next.
void add_error_feedback(PowerSGDState& state, PowerSgdBucket& pb) {
  auto it = state.error.find(pb.index);
  if (it != state.error.end() && it->second.sizes() == pb.buffer.sizes()) {
    pb.buffer.add_(it->second);
  } else {
    state.error[pb.index] = torch::zeros_like(pb.buffer);
  }
  pb.input_copy = reused(state.input_copy, pb.index, pb.buffer.sizes(), pb.buffer);
  pb.input_copy.copy_(pb.buffer);
}

// Splits the bucket into matrices worth compressing, grouped by shape in order of first
// appearance (PyTorch's order, which decides which random numbers each Q gets), and the rest.
void split_bucket(const GradBucket& bucket, const PowerSGDState& state, PowerSgdBucket& pb) {
  std::vector<std::pair<std::pair<int64_t, int64_t>, std::vector<at::Tensor>>> by_shape;
  int64_t offset = 0;
  for (const auto& g : bucket.gradients()) {
    auto flat = pb.buffer.narrow(0, offset, g.numel());
    offset += g.numel();
    if (g.dim() >= 1 && g.numel() > 0) {
      const int64_t n = g.size(0), m = g.numel() / n;
      const int64_t r = std::min({n, m, state.matrix_approximation_rank});
      if (static_cast<double>((n + m) * r) * state.min_compression_rate <
          static_cast<double>(n * m)) {
        auto matrix = flat.view({1, n, m});
        auto same = std::find_if(by_shape.begin(), by_shape.end(),
                                 [&](const auto& e) { return e.first == std::make_pair(n, m); });
        if (same == by_shape.end()) {
          by_shape.push_back({{n, m}, {matrix}});
        } else {
          same->second.push_back(matrix);
        }
        pb.p_total += n * r;
        pb.q_total += m * r;
        continue;
      }
    }
    pb.uncompressed.push_back(flat);
  }
  for (auto& entry : by_shape) {
    for (auto& matrix : entry.second) pb.matrices.push_back(matrix);
  }
}

// Binds the P and Q memories, kept between iterations, and each matrix's views into them; true
// when Q starts afresh (no warm start, or the bucket changed).
bool bind_memories(PowerSGDState& state, PowerSgdBucket& pb) {
  auto p_it = state.p_memory.find(pb.index);
  const bool fresh_q = !state.warm_start || p_it == state.p_memory.end() ||
                       p_it->second.numel() != pb.p_total ||
                       state.q_memory[pb.index].numel() != pb.q_total;
  if (fresh_q) {
    state.p_memory[pb.index] = torch::empty({pb.p_total}, pb.buffer.options());
    state.q_memory[pb.index] = torch::empty({pb.q_total}, pb.buffer.options());
  }
  pb.p_memory = state.p_memory[pb.index];
  pb.q_memory = state.q_memory[pb.index];
  int64_t p_offset = 0, q_offset = 0;
  for (const auto& matrix : pb.matrices) {
    const int64_t n = matrix.size(1), m = matrix.size(2);
    const int64_t r = std::min({n, m, state.matrix_approximation_rank});
    pb.ps.push_back(pb.p_memory.narrow(0, p_offset, n * r).view({1, n, r}));
    pb.qs.push_back(pb.q_memory.narrow(0, q_offset, m * r).view({1, m, r}));
    p_offset += n * r;
    q_offset += m * r;
  }
  return fresh_q;
}

// Orthonormalises the Qs kept from the last step, or draws new ones: the same random Qs on every
// rank, and the ones PyTorch's hook draws (see random_seed).
void prepare_qs(PowerSGDState& state, PowerSgdBucket& pb, bool fresh_q) {
  const double epsilon = state.orthogonalization_epsilon;
  if (!fresh_q) {
    for (auto& q : pb.qs) orthogonalize(q, epsilon);
  } else if (!pb.qs.empty()) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(next_q_seed(state));
    for (auto& q : pb.qs) {
      q.copy_(torch::randn(q.sizes(), generator, torch::TensorOptions().dtype(q.dtype())));
      orthogonalize(q, epsilon);
    }
  }
}

// Starts the reduction of the uncompressed tensors, computes P = M Q summed over ranks and
// orthonormalised, then starts Q = M^T P's sum (null when there is no matrix): the approximation
// is P Q^T / world.
std::shared_ptr<comm::Work> reduce_low_rank(comm::ProcessGroup& group, PowerSGDState& state,
                                            PowerSgdBucket& pb) {
  for (size_t i = 0; i < pb.matrices.size(); ++i) {
    torch::bmm_out(pb.ps[i], pb.matrices[i], pb.qs[i]);
  }
  comm::AllreduceOptions sum;
  sum.check = false;  // identical on every rank by construction, as in allreduce_hook
  if (!pb.uncompressed.empty()) {
    int64_t total = 0;
    for (const auto& t : pb.uncompressed) total += t.numel();
    pb.uncompressed_memory = reused(state.uncompressed_memory, pb.index, {total}, pb.buffer);
    torch::cat_out(pb.uncompressed_memory, pb.uncompressed);
    pb.uncompressed_work = group.allreduce(pb.uncompressed_memory, sum);
  }
  if (pb.p_total > 0) group.allreduce(pb.p_memory, sum)->wait();
  for (auto& p : pb.ps) orthogonalize(p, state.orthogonalization_epsilon);
  for (size_t i = 0; i < pb.matrices.size(); ++i) {
    torch::bmm_out(pb.qs[i], pb.matrices[i].transpose(1, 2), pb.ps[i]);
  }
  const int64_t uncompressed_total =
      pb.uncompressed_memory.defined() ? pb.uncompressed_memory.numel() : 0;
  state.bytes_sent += static_cast<double>((pb.p_total + pb.q_total + uncompressed_total) *
                                          static_cast<int64_t>(pb.buffer.element_size()));
  return pb.q_total > 0 ? group.allreduce(pb.q_memory, sum) : std::shared_ptr<comm::Work>();
}

// After the reductions: the uncompressed tensors averaged back into the bucket, the matrices
// replaced by their approximation, the error kept for the next step.
void finish_bucket(PowerSGDState& state, PowerSgdBucket& pb, double world) {
  torch::NoGradGuard no_grad;
  if (pb.uncompressed_work) {
    pb.uncompressed_work->wait();
    pb.uncompressed_memory.div_(world);
    int64_t at = 0;
    for (auto& t : pb.uncompressed) {
      t.copy_(pb.uncompressed_memory.narrow(0, at, t.numel()));
      at += t.numel();
    }
  }
  pb.q_memory.div_(world);
  for (size_t i = 0; i < pb.matrices.size(); ++i) {
    torch::bmm_out(pb.matrices[i], pb.ps[i], pb.qs[i].transpose(1, 2));
  }
  if (state.use_error_feedback) torch::sub_out(state.error[pb.index], pb.input_copy, pb.buffer);
  if (!state.warm_start) {  // PyTorch clears every bucket's memories
    state.p_memory.clear();
    state.q_memory.clear();
  }
}

// One bucket through PowerSGD (a plain allreduce before start_powerSGD_iter).
std::shared_ptr<comm::Work> powerSGD_bucket(const std::shared_ptr<comm::ProcessGroup>& group,
                                            const std::shared_ptr<PowerSGDState>& state,
                                            const CommHook& plain, GradBucket& bucket) {
  torch::NoGradGuard no_grad;
  at::Tensor buffer = bucket.buffer();
  if (state->iteration < state->start_powerSGD_iter) {
    if (bucket.is_last()) ++state->iteration;
    state->bytes_sent += static_cast<double>(buffer.numel() * buffer.element_size());
    return plain(bucket);
  }
  auto pb = std::make_shared<PowerSgdBucket>();
  pb->index = bucket.index();
  pb->buffer = buffer;
  if (state->use_error_feedback) add_error_feedback(*state, *pb);
  split_bucket(bucket, *state, *pb);
  prepare_qs(*state, *pb, bind_memories(*state, *pb));
  std::shared_ptr<comm::Work> q_work = reduce_low_rank(*group, *state, *pb);
  if (bucket.is_last()) ++state->iteration;
  const double world = group->size();
  auto finish = [state, pb, world]() { finish_bucket(*state, *pb, world); };
  if (q_work) return then(std::move(q_work), std::move(finish));
  if (pb->uncompressed_work) {
    auto work = pb->uncompressed_work;
    return then(std::move(work), std::move(finish));
  }
  finish();
  return plain(bucket);  // nothing to compress or reduce: cannot happen with a non-empty bucket
}

}  // namespace

CommHook powerSGD_hook(std::shared_ptr<comm::ProcessGroup> group,
                       std::shared_ptr<PowerSGDState> state) {
  SHOAL_CHECK_T(InvalidArgument, group != nullptr, "powerSGD_hook: the process group is null");
  SHOAL_CHECK_T(InvalidArgument, state != nullptr && state->matrix_approximation_rank > 0,
                "powerSGD_hook: needs a state with matrix_approximation_rank >= 1");
  SHOAL_CHECK_T(InvalidArgument,
                state->start_powerSGD_iter > 1 || !(state->use_error_feedback || state->warm_start),
                "powerSGD_hook: start_powerSGD_iter must be > 1 with use_error_feedback or "
                "warm_start (DDP rebuilds its buckets after the first iteration), not ",
                state->start_powerSGD_iter);
  CommHook plain = allreduce_hook(group);
  return [group, state, plain](GradBucket& bucket) {
    return powerSGD_bucket(group, state, plain, bucket);
  };
}

}  // namespace shoal::parallel
