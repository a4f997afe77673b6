#include "shoal/data/exactly_once_sampler.h"

#include <ATen/ATen.h>

#include "shoal/data/distributed_sampler.h"
#include "shoal/error.h"

namespace shoal::data {

ExactlyOnceSampler::ExactlyOnceSampler(int64_t size, int rank, int num_replicas,
                                       ExactlyOnceSamplerOptions options)
    : size_(size), rank_(rank), num_replicas_(num_replicas), options_(options) {
  SHOAL_CHECK_T(InvalidArgument, size_ >= 0, "ExactlyOnceSampler: size is ", size_,
                "; it must not be negative");
  SHOAL_CHECK_T(InvalidArgument, num_replicas_ > 0, "ExactlyOnceSampler: num_replicas is ",
                num_replicas_, "; it must be positive");
  SHOAL_CHECK_T(InvalidArgument, rank_ >= 0 && rank_ < num_replicas_, "ExactlyOnceSampler: rank ",
                rank_, " is outside [0, ", num_replicas_ - 1, "]");
  set_epoch(0);
}

void ExactlyOnceSampler::set_epoch(uint64_t epoch, int64_t consumed) {
  SHOAL_CHECK_T(InvalidArgument, consumed >= 0 && consumed <= size_, "ExactlyOnceSampler: ",
                consumed, " indices consumed of an epoch of ", size_);
  if (!order_.defined() || epoch != epoch_) {
    order_ = epoch_permutation(size_, options_.shuffle, options_.seed, epoch);
  }
  epoch_ = epoch;
  consumed_ = consumed;
}

int64_t ExactlyOnceSampler::size() const {
  const int64_t left = size_ - consumed_;
  if (options_.drop_last) return left / num_replicas_;
  return left / num_replicas_ + (rank_ < left % num_replicas_ ? 1 : 0);
}

at::Tensor ExactlyOnceSampler::indices() const {
  const int64_t count = size();
  if (count == 0) return at::empty({0}, at::kLong);
  return order_.slice(0, consumed_ + rank_, consumed_ + rank_ + (count - 1) * num_replicas_ + 1,
                      num_replicas_)
      .contiguous();
}

int64_t ExactlyOnceSampler::consumed_after(int64_t per_rank) const {
  SHOAL_CHECK_T(InvalidArgument, per_rank >= 0, "ExactlyOnceSampler: ", per_rank,
                " indices taken per rank");
  return std::min(size_, consumed_ + per_rank * num_replicas_);
}

}  // namespace shoal::data
