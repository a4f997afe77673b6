#include "shoal/pipeline/schedule.h"

#include <algorithm>
#include <cctype>

#include "shoal/error.h"

namespace shoal::pipeline {

const char* to_string(Schedule schedule) {
  return schedule == Schedule::kGPipe ? "gpipe" : "1f1b";
}

Schedule schedule_from_string(const std::string& name) {
  std::string lower = name;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == "gpipe") return Schedule::kGPipe;
  if (lower == "1f1b") return Schedule::k1F1B;
  SHOAL_THROW(InvalidArgument, "unknown pipeline schedule '", name, "'; use gpipe or 1f1b");
}

std::vector<PipelineAction> schedule_actions(Schedule schedule, int stages, int stage,
                                             int64_t micro_batches) {
  SHOAL_CHECK_T(InvalidArgument, stages >= 1 && stage >= 0 && stage < stages,
                "schedule_actions: stage ", stage, " is not one of ", stages, " stages");
  SHOAL_CHECK_T(InvalidArgument, micro_batches >= 1,
                "schedule_actions: at least one micro-batch is needed, not ", micro_batches);
  std::vector<PipelineAction> actions;
  actions.reserve(static_cast<size_t>(2 * micro_batches));
  const auto forward = [&](int64_t i) { actions.push_back({PipelineAction::kForward, i}); };
  const auto backward = [&](int64_t i) { actions.push_back({PipelineAction::kBackward, i}); };
  if (schedule == Schedule::kGPipe) {
    for (int64_t i = 0; i < micro_batches; ++i) forward(i);
    for (int64_t i = 0; i < micro_batches; ++i) backward(i);
    return actions;
  }
  // 1F1B: the warm-up fills the pipeline below this stage; the last stage starts backward at once.
  const int64_t warmup = std::min<int64_t>(stages - 1 - stage, micro_batches);
  for (int64_t i = 0; i < warmup; ++i) forward(i);
  for (int64_t i = 0; i < micro_batches - warmup; ++i) {
    forward(warmup + i);
    backward(i);
  }
  for (int64_t i = micro_batches - warmup; i < micro_batches; ++i) backward(i);
  return actions;
}

int64_t max_in_flight(const std::vector<PipelineAction>& actions) {
  int64_t live = 0;
  int64_t most = 0;
  for (const PipelineAction& action : actions) {
    live += action.kind == PipelineAction::kForward ? 1 : -1;
    most = std::max(most, live);
  }
  return most;
}

double theoretical_bubble_fraction(int stages, int64_t micro_batches) {
  return static_cast<double>(stages - 1) / static_cast<double>(micro_batches + stages - 1);
}

}  // namespace shoal::pipeline
