// ExactlyOnceSampler: deals an epoch's indices to ranks so that each index is taken exactly once
// across the job, and resumes mid-epoch: the dealing a dataset too large to repeat needs (a token
// stream's blocks, an image folder's files).
//
// The epoch's order is DistributedSampler's: torch.randperm(size) under a generator seeded with
// seed + epoch (epoch_permutation(), bit-identical to PyTorch's), the same at any world size. Rank
// r of W takes order[consumed + r], order[consumed + r + W], ... where `consumed` is how many
// indices of the epoch the job has already taken: after every rank took k indices, the job has
// taken exactly order[0, consumed + k * W), a prefix, whatever W was. So a job resumed with
// set_epoch(epoch, consumed) continues with the next unseen index, even at another world size.
//
// Unlike DistributedSampler there is no padding: the ranks' counts differ by at most one (ranks
// below (size - consumed) % W take one more). With drop_last, the last (size - consumed) % W
// indices of the order are left out of the epoch instead, so every rank takes the same count (each
// index at most once, and a different few left out each epoch).
//
// Thread safety: not thread-safe; one instance per rank.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace shoal::data {

struct ExactlyOnceSamplerOptions {
  /// Shuffle each epoch (seed + epoch); otherwise the order is 0..size-1.
  bool shuffle = true;
  uint64_t seed = 0;
  /// Equal counts on every rank, leaving out the last (size - consumed) % num_replicas indices.
  bool drop_last = false;
};

class ExactlyOnceSampler {
 public:
  /// `size` indices dealt among `num_replicas` ranks; this is `rank`. Throws InvalidArgument for
  /// a negative size or a rank outside [0, num_replicas).
  ExactlyOnceSampler(int64_t size, int rank, int num_replicas,
                     ExactlyOnceSamplerOptions options = {});

  /// Selects the epoch's order and where the job is in it: `consumed` indices of this epoch were
  /// already taken across the job (0 for a new epoch; see consumed_after()). Throws
  /// InvalidArgument unless 0 <= consumed <= size.
  void set_epoch(uint64_t epoch, int64_t consumed = 0);
  uint64_t epoch() const { return epoch_; }
  int64_t consumed() const { return consumed_; }

  /// This rank's indices of the epoch from `consumed` on, in order: [k] int64.
  at::Tensor indices() const;
  /// The count indices() returns.
  int64_t size() const;
  /// The epoch's whole order, [size] int64: the same at any world size.
  const at::Tensor& order() const { return order_; }
  /// The job-wide `consumed` once every rank has taken `per_rank` more of its indices (what to
  /// save in a checkpoint to resume mid-epoch).
  int64_t consumed_after(int64_t per_rank) const;

  int rank() const { return rank_; }
  int num_replicas() const { return num_replicas_; }

 private:
  int64_t size_;
  int rank_;
  int num_replicas_;
  ExactlyOnceSamplerOptions options_;
  uint64_t epoch_ = 0;
  int64_t consumed_ = 0;
  at::Tensor order_;
};

}  // namespace shoal::data
