// Megatron's f and g for the layers parallelize_module replaces, summing in place the tensors only
// such a layer refers to (no copy of a [batch, tokens, width] activation per collective). The
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

/// copy_to_tensor_parallel_region for the input of one Linear that nothing else consumes: the
/// gradient reaching it is the Linear's fresh input gradient, summed in place in backward.
at::Tensor copy_to_region_for_layer(const at::Tensor& input,
                                    std::shared_ptr<comm::ProcessGroup> group);
/// reduce_from_tensor_parallel_region of a layer's fresh output (no other reference to it), summed
/// in place.
at::Tensor reduce_layer_output(const at::Tensor& output,
                               std::shared_ptr<comm::ProcessGroup> group);

}  // namespace shoal::parallel
