#include "shoal/data/batch_dataset.h"

#include <ATen/ATen.h>

#include "shoal/error.h"

namespace shoal::data {

TensorDataset::TensorDataset(at::Tensor inputs, at::Tensor targets)
    : inputs_(std::move(inputs)), targets_(std::move(targets)) {
  SHOAL_CHECK_T(InvalidArgument, inputs_.defined() && targets_.defined(),
                "TensorDataset: inputs and targets must both be tensors");
  SHOAL_CHECK_T(InvalidArgument, inputs_.dim() >= 1 && targets_.dim() >= 1,
                "TensorDataset: inputs and targets need a first (sample) dimension");
  SHOAL_CHECK_T(InvalidArgument, inputs_.size(0) == targets_.size(0), "TensorDataset: ",
                inputs_.size(0), " inputs but ", targets_.size(0), " targets");
}

Batch TensorDataset::get_batch(const at::Tensor& indices) const {
  return {inputs_.index_select(0, indices), targets_.index_select(0, indices)};
}

SubsetDataset::SubsetDataset(const BatchDataset& dataset, int64_t begin, int64_t end)
    : dataset_(&dataset), begin_(begin), end_(end) {
  SHOAL_CHECK_T(InvalidArgument, 0 <= begin && begin <= end && end <= dataset.size(),
                "SubsetDataset: [", begin, ", ", end, ") is not a range of a dataset of ",
                dataset.size(), " samples");
}

Batch SubsetDataset::get_batch(const at::Tensor& indices) const {
  return dataset_->get_batch(begin_ == 0 ? indices : indices + begin_);
}

}  // namespace shoal::data
