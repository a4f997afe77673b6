// Pipeline schedules: the order in which one stage runs the forward and backward passes of a
// step's micro-batches.
//
//   GPipe: every forward (0 .. M-1), then every backward (0 .. M-1). A stage holds the
//          activations of all M micro-batches at once.
//   1F1B:  stage s of K first runs min(K-1-s, M) forwards (warm-up), then alternates one forward
//          and one backward, then runs the remaining backwards (cool-down). A stage holds the
//          activations of at most K - s micro-batches at once: less than GPipe when M > K - s.
//
// Both give the same gradients (backwards run in micro-batch order on every stage, so gradients
// accumulate in the same order); they differ in peak activation memory, not in the bubble:
// (K-1)/(M+K-1) of a step is idle in both.
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shoal::pipeline {

enum class Schedule { kGPipe, k1F1B };

/// "gpipe", "1f1b".
const char* to_string(Schedule schedule);
/// Parses "gpipe" or "1f1b" (case-insensitive); throws InvalidArgument otherwise.
Schedule schedule_from_string(const std::string& name);

/// One step of a stage's program.
struct PipelineAction {
  enum Kind { kForward, kBackward };
  Kind kind = kForward;
  int64_t micro_batch = 0;
  bool operator==(const PipelineAction& other) const {
    return kind == other.kind && micro_batch == other.micro_batch;
  }
};

/// The program of stage `stage` (0-based) of `stages` for `micro_batches` micro-batches: every
/// micro-batch's forward once and its backward once, the backward after the forward.
std::vector<PipelineAction> schedule_actions(Schedule schedule, int stages, int stage,
                                             int64_t micro_batches);

/// The most micro-batches whose forward ran and backward did not yet, over the program.
int64_t max_in_flight(const std::vector<PipelineAction>& actions);

/// The idle fraction of an ideal pipeline whose stages take equal time: (K-1)/(M+K-1).
double theoretical_bubble_fraction(int stages, int64_t micro_batches);

}  // namespace shoal::pipeline
