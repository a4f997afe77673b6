#include "shoal/pipeline/pipeline_grid.h"

#include "shoal/error.h"

namespace shoal::pipeline {

PipelineGrid::PipelineGrid(std::shared_ptr<comm::ProcessGroup> group, int stages)
    : group_(std::move(group)), stages_(stages) {
  SHOAL_CHECK_T(InvalidArgument, group_ != nullptr, "PipelineGrid: no process group given");
  SHOAL_CHECK_T(InvalidArgument, stages >= 1 && group_->size() % stages == 0,
                group_->rank_prefix(), " PipelineGrid: ", group_->size(),
                " ranks cannot form pipelines of ", stages,
                " stages; the world size must be stages x replicas");
  replicas_ = group_->size() / stages_;
  if (replicas_ == 1) return;
  for (int s = 0; s < stages_; ++s) {
    std::vector<int> ranks;
    for (int r = 0; r < replicas_; ++r) ranks.push_back(rank_of(s, r));
    auto sub = group_->new_group(ranks);
    if (s == stage()) stage_group_ = std::move(sub);
  }
}

std::vector<int> PipelineGrid::stage_ranks() const {
  std::vector<int> ranks;
  for (int s = 0; s < stages_; ++s) ranks.push_back(rank_of(s, replica()));
  return ranks;
}

}  // namespace shoal::pipeline
