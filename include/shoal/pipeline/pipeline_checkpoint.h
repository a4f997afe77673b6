// Checkpoints of a pipelined model are one ordinary state dict.
//
// Every rank keeps the whole model (the stages' modules share its layers, see stage_module) but
// trains only its stage's layers. gather_stages() copies each stage's trained parameters, buffers
// and optimizer state from the rank that trains it to every rank, so that afterwards the whole
// model on any rank is the trained model: checkpoint::capture() of it (rank 0 writes) is the same
// file a one-process or DDP run writes, torch.load() reads it, and any strategy resumes from it.
// Loading is splitting: checkpoint::restore() into the whole model on every rank puts each
// stage's weights into the layers its module shares.
//
// Thread safety: a collective on the grid's group; one thread per rank.
#pragma once

#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <vector>

#include "shoal/pipeline/pipeline_grid.h"

namespace shoal::pipeline {

/// Broadcasts stage s's parameters and buffers (and, given `optimizer` over parameters of `model`,
/// their optimizer state) from replica 0 of stage s to every rank of grid.group(), for every s.
/// `model` is the whole model, `balance` its partition into grid.stages() stages.
void gather_stages(const torch::nn::Sequential& model, const std::vector<int64_t>& balance,
                   const PipelineGrid& grid, torch::optim::Optimizer* optimizer = nullptr);

}  // namespace shoal::pipeline
