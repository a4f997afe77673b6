#include "shoal/data/synthetic_dataset.h"

#include <ATen/CPUGeneratorImpl.h>

#include "shoal/error.h"

namespace shoal::data {

SyntheticDataset::SyntheticDataset(SyntheticOptions options) : options_(std::move(options)) {
  SHOAL_CHECK_T(InvalidArgument, options_.size >= 0, "SyntheticDataset: size must be >= 0, got ",
                options_.size);
  SHOAL_CHECK_T(InvalidArgument, options_.num_classes >= 1,
                "SyntheticDataset: num_classes must be >= 1, got ", options_.num_classes);
  int64_t features = 1;
  for (int64_t d : options_.sample_shape) {
    SHOAL_CHECK_T(InvalidArgument, d >= 1, "SyntheticDataset: sample_shape entries must be >= 1");
    features *= d;
  }
  // A private generator: the data depend on the seed only, never on what else drew from the
  // global generator before.
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(options_.seed);
  std::vector<int64_t> shape{options_.size};
  shape.insert(shape.end(), options_.sample_shape.begin(), options_.sample_shape.end());
  images_ = at::randn(shape, generator, at::kFloat);
  const at::Tensor teacher = at::randn({features, options_.num_classes}, generator, at::kFloat);
  // Labels in double precision so that rounding in a threaded BLAS cannot flip a near tie.
  targets_ = images_.reshape({options_.size, features})
                 .to(at::kDouble)
                 .mm(teacher.to(at::kDouble))
                 .argmax(1)
                 .contiguous();
}

torch::data::Example<> SyntheticDataset::get(size_t index) {
  SHOAL_CHECK_T(InvalidArgument, index < static_cast<size_t>(options_.size),
                "SyntheticDataset::get: index ", index, " is out of range for ", options_.size,
                " samples");
  const auto i = static_cast<int64_t>(index);
  return {images_[i], targets_[i]};
}

c10::optional<size_t> SyntheticDataset::size() const {
  return static_cast<size_t>(options_.size);
}

}  // namespace shoal::data
