// CheckpointManager: numbered checkpoints in one folder, the last K kept, and resume.
//
// Files are "<dir>/checkpoint_000012.pt" (a sequence number, one more than the highest present)
// plus "<dir>/latest", a one-line text file naming the newest complete checkpoint; both are written
// atomically (see serialization.h), so a job killed while saving resumes from the previous one.
// Each save first removes what interrupted saves left: sharded folders without a manifest (or DCP
// `.metadata`) newer
// than "latest"'s checkpoint, and temporary files of dead writers; only complete checkpoints count
// toward keep_last.
//
// In a distributed job pass the process group: rank 0 writes, and every rank returns from save()
// only after the file is complete (rank 0 broadcasts the outcome, so a failed write throws on
// every rank). Loading reads the file on every rank (the folder must be shared, or copied).
//
// Typical use in a training loop:
//   CheckpointManager checkpoints(dir, /*keep_last=*/3);
//   if (auto state = checkpoints.load_latest()) { restore(*state, model, &optimizer); ... }
//   ...
//   auto state = capture(model, &optimizer); state.epoch = e; state.step = s; ...
//   checkpoints.save(state, pg.get());
//
// Thread safety: one thread per manager; one writer per folder.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "shoal/checkpoint/serialization.h"
#include "shoal/checkpoint/sharded_checkpoint.h"
#include "shoal/checkpoint/training_state.h"

namespace shoal::comm {
class ProcessGroup;
}

namespace shoal::checkpoint {

struct CheckpointManagerOptions {
  /// Checkpoints kept; older ones are deleted after each save. 0 keeps all.
  int keep_last = 3;
  /// File names are "<prefix><6-digit number>.pt".
  std::string prefix = "checkpoint_";
};

class CheckpointManager {
 public:
  /// Creates `dir` when it does not exist.
  explicit CheckpointManager(std::string dir, CheckpointManagerOptions options = {});
  CheckpointManager(std::string dir, int keep_last);

  /// Writes the next checkpoint, updates `latest` and deletes the oldest beyond keep_last.
  /// Returns the new file's path (on every rank). With `pg`, only rank 0 writes; all ranks wait.
  std::string save(const TrainingState& state, comm::ProcessGroup* pg = nullptr);

  /// Writes the next checkpoint as a sharded one (see sharded_checkpoint.h): every rank of `pg`
  /// calls it with its own piece and writes "<dir>/<prefix>N.sharded/__<rank>_0.distcp" under one
  /// new save id (state.save_id is replaced); once all files are complete rank 0 writes the
  /// folder's DCP `.metadata`, points `latest` at the folder and deletes the oldest checkpoints beyond
  /// keep_last. A failure on any rank throws on every rank and keeps the previous checkpoint the
  /// latest. Returns the folder's path. A collective.
  std::string save_sharded(const ShardedTrainingState& state, comm::ProcessGroup* pg = nullptr);

  /// The newest intact checkpoint, or nullopt when there is none. A newer one that cannot be read
  /// is skipped with a warning on stderr naming it and why (see load_latest_intact); throws
  /// CheckpointError when checkpoints exist but none can be read.
  std::optional<TrainingState> load_latest(const LoadOptions& options = {}) const;

  /// Path of the newest checkpoint, if any.
  std::optional<std::string> latest_path() const;

  /// The checkpoints present, oldest first.
  std::vector<std::string> list() const;

  const std::string& directory() const { return dir_; }

 private:
  std::string write(const TrainingState& state);

  std::string dir_;
  CheckpointManagerOptions options_;
};

/// A checkpoint found for resuming, and the newer ones passed over.
struct ResumePoint {
  std::string path;
  TrainingState state;
  /// "<path>: <why it cannot be read>" for each newer checkpoint skipped, newest first.
  std::vector<std::string> skipped;
};

/// Loads the newest checkpoint in `dir` that reads back intact: the one "latest" names first, then
/// the numbered ones from the highest down. nullopt when `dir` holds none; throws CheckpointError
/// listing every file and its damage when none can be read.
std::optional<ResumePoint> load_latest_intact(const std::string& dir, const LoadOptions& options = {},
                                              const std::string& prefix = "checkpoint_");

/// The newest checkpoint in `dir` ("latest" when it names an existing file or sharded folder,
/// else the highest numbered "checkpoint_N.pt" or "checkpoint_N.sharded"), or nullopt.
std::optional<std::string> find_latest(const std::string& dir, const std::string& prefix = "checkpoint_");

}  // namespace shoal::checkpoint
