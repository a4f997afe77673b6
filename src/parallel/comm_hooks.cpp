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

CommHook allreduce_hook(std::shared_ptr<comm::ProcessGroup> group) {
  SHOAL_CHECK_T(InvalidArgument, group != nullptr, "allreduce_hook: the process group is null");
  return [group](GradBucket& bucket) {
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

// Gram-Schmidt on the columns of `matrix` (n x r), in place.
void orthogonalize(at::Tensor& matrix) {
  constexpr double kEpsilon = 1e-8;  // a zero column stays finite (PyTorch adds an epsilon too)
  const int64_t columns = matrix.size(1);
  for (int64_t i = 0; i < columns; ++i) {
    auto column = matrix.narrow(1, i, 1);
    column.div_(column.norm().add_(kEpsilon));
    if (i + 1 < columns) {
      auto rest = matrix.narrow(1, i + 1, columns - i - 1);
      rest.sub_(column * (column * rest).sum(0, /*keepdim=*/true));
    }
  }
}

// One bucket's PowerSGD step after the P allreduce: the Q allreduce is left in flight.
struct PowerSgdBucket {
  at::Tensor input_copy;                 // the gradients with the error added, for feedback
  std::vector<at::Tensor> matrices;      // views of the bucket compressed as n x m matrices
  std::vector<at::Tensor> ps, qs;        // n x r and m x r, views into the P and Q memories
  at::Tensor uncompressed_views_memory;  // flattened vectors and small matrices, reduced whole
  std::vector<at::Tensor> uncompressed;  // views of the bucket reduced uncompressed
};

}  // namespace

CommHook powerSGD_hook(std::shared_ptr<comm::ProcessGroup> group,
                       std::shared_ptr<PowerSGDState> state) {
  SHOAL_CHECK_T(InvalidArgument, group != nullptr, "powerSGD_hook: the process group is null");
  SHOAL_CHECK_T(InvalidArgument, state != nullptr && state->matrix_approximation_rank > 0,
                "powerSGD_hook: needs a state with matrix_approximation_rank >= 1");
  CommHook plain = allreduce_hook(group);
  return [group, state, plain](GradBucket& bucket) -> std::shared_ptr<comm::Work> {
    torch::NoGradGuard no_grad;
    auto advance = [state, &bucket] {
      if (bucket.is_last()) ++state->iteration;
    };
    if (state->iteration < state->start_powerSGD_iter) {
      advance();
      state->bytes_sent +=
          static_cast<double>(bucket.buffer().numel() * bucket.buffer().element_size());
      return plain(bucket);
    }
    const double world = group->size();
    const size_t index = bucket.index();
    at::Tensor buffer = bucket.buffer();
    auto pb = std::make_shared<PowerSgdBucket>();
    if (state->use_error_feedback) {
      auto& error = state->error[index];
      if (error.defined() && error.sizes() == buffer.sizes()) {
        buffer.add_(error);
      } else {
        error = torch::zeros_like(buffer);
      }
      pb->input_copy = buffer.clone();
    }
    // Split the bucket: matrices worth compressing, and the rest (vectors, small matrices).
    int64_t offset = 0, p_total = 0, q_total = 0, uncompressed_total = 0;
    std::vector<std::pair<int64_t, int64_t>> ranks_of;  // (n, m) per matrix
    for (const auto& g : bucket.gradients()) {
      auto t = buffer.narrow(0, offset, g.numel());
      offset += g.numel();
      if (g.dim() > 1) {
        const int64_t n = g.size(0), m = g.numel() / std::max<int64_t>(n, 1);
        const int64_t r = std::min<int64_t>({n, m, state->matrix_approximation_rank});
        if ((n + m) * r < n * m) {
          pb->matrices.push_back(t.view({n, m}));
          p_total += n * r;
          q_total += m * r;
          continue;
        }
      }
      pb->uncompressed.push_back(t);
      uncompressed_total += t.numel();
    }
    // P and Q memories, kept between iterations (warm start reuses Q).
    auto& p_memory = state->p_memory[index];
    auto& q_memory = state->q_memory[index];
    const bool fresh_q = !state->warm_start || !q_memory.defined() || q_memory.numel() != q_total;
    if (!p_memory.defined() || p_memory.numel() != p_total) {
      p_memory = torch::empty({p_total}, buffer.options());
    }
    if (fresh_q) {
      // The same random Q on every rank: a generator seeded from the state, bucket and step.
      auto generator = at::make_generator<at::CPUGeneratorImpl>(
          state->random_seed + 1000003ull * index + static_cast<uint64_t>(state->iteration));
      q_memory = torch::randn({q_total}, generator, buffer.options());
    }
    int64_t p_offset = 0, q_offset = 0;
    for (const auto& matrix : pb->matrices) {
      const int64_t n = matrix.size(0), m = matrix.size(1);
      const int64_t r = std::min<int64_t>({n, m, state->matrix_approximation_rank});
      pb->ps.push_back(p_memory.narrow(0, p_offset, n * r).view({n, r}));
      pb->qs.push_back(q_memory.narrow(0, q_offset, m * r).view({m, r}));
      p_offset += n * r;
      q_offset += m * r;
    }
    if (fresh_q) {
      for (auto& q : pb->qs) orthogonalize(q);
    }
    // Uncompressed part and P = M Q (summed over ranks), then P orthonormalised.
    comm::AllreduceOptions sum;
    sum.check = false;  // identical on every rank by construction, as in allreduce_hook
    std::shared_ptr<comm::Work> uncompressed_work;
    if (uncompressed_total > 0) {
      std::vector<at::Tensor> flat;
      for (const auto& t : pb->uncompressed) flat.push_back(t);
      pb->uncompressed_views_memory = torch::cat(flat);
      uncompressed_work = group->allreduce(pb->uncompressed_views_memory, sum);
    }
    for (size_t i = 0; i < pb->matrices.size(); ++i) {
      torch::matmul_out(pb->ps[i], pb->matrices[i], pb->qs[i]);
    }
    if (p_total > 0) group->allreduce(p_memory, sum)->wait();
    for (auto& p : pb->ps) orthogonalize(p);
    // Q = M^T P, summed over ranks: the approximation is P Q^T / world.
    for (size_t i = 0; i < pb->matrices.size(); ++i) {
      torch::matmul_out(pb->qs[i], pb->matrices[i].t(), pb->ps[i]);
    }
    std::shared_ptr<comm::Work> q_work =
        q_total > 0 ? group->allreduce(q_memory, sum) : std::shared_ptr<comm::Work>();
    state->bytes_sent += static_cast<double>((p_total + q_total + uncompressed_total) *
                                             static_cast<int64_t>(buffer.element_size()));
    advance();
    auto finish = [state, pb, buffer, index, world, q_memory, uncompressed_work]() mutable {
      torch::NoGradGuard no_grad;
      if (uncompressed_work) {
        uncompressed_work->wait();
        int64_t at = 0;
        for (auto& t : pb->uncompressed) {
          t.copy_(pb->uncompressed_views_memory.narrow(0, at, t.numel()).div_(world));
          at += t.numel();
        }
      }
      q_memory.div_(world);
      for (size_t i = 0; i < pb->matrices.size(); ++i) {
        torch::matmul_out(pb->matrices[i], pb->ps[i], pb->qs[i].t());
      }
      if (state->use_error_feedback) state->error[index] = pb->input_copy - buffer;
      if (!state->warm_start) {
        state->p_memory.erase(index);
        state->q_memory.erase(index);
      }
    };
    if (q_work) return then(std::move(q_work), std::move(finish));
    if (uncompressed_work) {
      auto work = uncompressed_work;
      return then(std::move(work), std::move(finish));
    }
    finish();
    return plain(bucket);  // nothing to compress or reduce: cannot happen with a non-empty bucket
  };
}

}  // namespace shoal::parallel
