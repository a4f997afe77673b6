// Megatron's f and g for the layers parallelize_module replaces, summing in place the tensors only
// such a layer refers to (no copy of a [batch, tokens, width] activation per collective), and the
// column-split layer's backward overlapping its collective with its weight's gradient. The
// public copy_to_tensor_parallel_region and reduce_from_tensor_parallel_region sum into new
// tensors: their callers' tensors may be referred to elsewhere. Private to src/parallel/.
//
// Thread safety: as the public functions (a collective over the group per call).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>

namespace shoal::comm {
class ProcessGroup;
}

namespace shoal::parallel {

/// at::linear(copy_to_tensor_parallel_region(input, group), weight, bias) with the backward's
/// collective overlapping the weight's gradient: the same collectives, results equal but for
/// rounding.
at::Tensor column_parallel_linear(const at::Tensor& input, const at::Tensor& weight,
                                  const at::Tensor& bias,
                                  std::shared_ptr<comm::ProcessGroup> group);
/// reduce_from_tensor_parallel_region of a layer's fresh output (no other reference to it), summed
/// in place.
at::Tensor reduce_layer_output(const at::Tensor& output,
                               std::shared_ptr<comm::ProcessGroup> group);

}  // namespace shoal::parallel
