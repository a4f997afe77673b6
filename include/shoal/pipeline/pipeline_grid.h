// PipelineGrid: the ranks of a job arranged as K pipeline stages x R data-parallel replicas.
//
// Rank r of the group is stage r % K of replica r / K: each replica's pipeline is K consecutive
// ranks (on one host under a node-major launcher, where point-to-point traffic is heaviest), and
// stage s's replicas are ranks s, K + s, 2K + s, ... They reduce that stage's gradients through
// a sub-group of their own (new_group), which DistributedDataParallel runs over.
//
// Thread safety: built and used by one thread per rank.
#pragma once

#include <memory>
#include <vector>

#include "shoal/comm/process_group.h"

namespace shoal::pipeline {

class PipelineGrid {
 public:
  /// Splits `group` (its size a multiple of `stages`). With more than one replica this is a
  /// collective on `group`: every rank creates the K stage groups, in order.
  PipelineGrid(std::shared_ptr<comm::ProcessGroup> group, int stages);

  int stages() const { return stages_; }
  int replicas() const { return replicas_; }
  int stage() const { return group_->rank() % stages_; }
  int replica() const { return group_->rank() / stages_; }
  /// The rank in group() of `stage` of `replica`.
  int rank_of(int stage, int replica) const { return replica * stages_ + stage; }
  /// The ranks of this replica's stages, in stage order (for Pipeline).
  std::vector<int> stage_ranks() const;

  const std::shared_ptr<comm::ProcessGroup>& group() const { return group_; }
  /// This stage's replicas (null with one replica).
  const std::shared_ptr<comm::ProcessGroup>& stage_group() const { return stage_group_; }

 private:
  std::shared_ptr<comm::ProcessGroup> group_;
  int stages_;
  int replicas_;
  std::shared_ptr<comm::ProcessGroup> stage_group_;
};

}  // namespace shoal::pipeline
