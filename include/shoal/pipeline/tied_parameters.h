// TiedParameters: parameters that layers of more than one pipeline stage use, kept equal across
// those stages the way Megatron-LM keeps a language model's word embeddings (the GPT's token
// embedding, tied to its output head, is used by the first stage and by the last).
//
// Every rank holds its own copy of the whole model, so each stage that uses a tied parameter
// trains its own copy. The copies start equal (the constructor broadcasts each from the first
// stage that uses it), and after each backward all_reduce_gradients() sums their gradients over a
// group of the ranks holding them (one group per replica of the pipeline), so every copy takes
// the same optimizer step and stays equal: the step a single process takes on the one tied
// tensor, whose gradient is the sum of its uses'. A global gradient norm counts each tied
// gradient once: on its first stage (copies() lists the others').
//
// Thread safety: a collective on the grid's group; one thread per rank.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "shoal/comm/process_group.h"
#include "shoal/pipeline/pipeline_grid.h"

namespace shoal::pipeline {

class TiedParameters {
 public:
  /// Finds the parameters that more than one stage of `model` (cut by `balance` into
  /// grid.stages() stages) holds, creates the groups of the ranks holding each (a collective
  /// on grid.group(): every rank creates every group, in the same order) and broadcasts each
  /// parameter from the first stage holding it. With one stage, or none shared, it does nothing.
  TiedParameters(const torch::nn::Sequential& model, const std::vector<int64_t>& balance,
                 const PipelineGrid& grid);
  ~TiedParameters();

  /// The number of tied parameters this stage holds.
  size_t size() const { return held_.size(); }
  /// Sums the gradient of each tied parameter this stage holds over the stages holding it (a
  /// gradient not yet defined counts as zeros). Every rank holding one calls it after the
  /// backward (and, with replicas, after their gradients were averaged), before the step.
  void all_reduce_gradients();
  /// The tied parameters this stage holds as a copy (a stage before it holds it too).
  std::vector<at::Tensor> copies() const;

 private:
  struct Held {
    at::Tensor parameter;
    std::shared_ptr<comm::ProcessGroup> group;  // the ranks of this replica holding it
    bool first = false;                         // this is the first stage holding it
  };
  std::vector<Held> held_;
};

}  // namespace shoal::pipeline
